// Python's fnmatch.fnmatchcase, rewritten from its documented behaviour and fnmatch.translate: the pattern becomes a
// list of one-character matchers and '*' runs, matched against the whole name. Character sets are built the way
// translate builds them: a ']' right after '[' or '[!' is a member, '-' between two members is a range, a range whose
// ends are reversed is dropped together with both ends, an unclosed '[' is a literal '[', backslashes are plain
// characters, and '^' after '[' is a member (only '!' negates). Bytes are compared, which equals Python's code
// point comparison for the ASCII module names this is used on.
#include <string>
#include <vector>

#include "io/quant_config.h"

namespace tern {

namespace {

struct GlobItem {
  enum class Kind { kStar, kAnyChar, kNever, kSet } kind = Kind::kSet;
  bool negate = false;
  std::string members;                        // single characters
  std::vector<std::pair<char, char>> ranges;  // inclusive

  bool matches(char c) const {
    if (kind == Kind::kAnyChar) return true;
    if (kind == Kind::kNever) return false;
    bool in = members.find(c) != std::string::npos;
    for (const auto& [lo, hi] : ranges) in = in || (lo <= c && c <= hi);
    return in != negate;
  }
};

GlobItem literal_item(char c) {
  GlobItem item;
  item.members.assign(1, c);
  return item;
}

// translate's range handling: split the set body at '-' separators into chunks, then drop reversed ranges.
std::vector<std::string> split_set_chunks(std::string_view body) {
  std::vector<std::string> chunks;
  size_t start = 0;
  size_t k = body[0] == '!' ? 2 : 1;
  while (k < body.size()) {
    const size_t dash = body.find('-', k);
    if (dash == std::string_view::npos) break;
    chunks.emplace_back(body.substr(start, dash - start));
    start = dash + 1;
    k = dash + 3;
  }
  const std::string_view last = body.substr(std::min(start, body.size()));
  if (!last.empty()) {
    chunks.emplace_back(last);
  } else if (!chunks.empty()) {
    chunks.back() += '-';
  }
  for (size_t i = chunks.size() - 1; i >= 1 && i < chunks.size(); --i) {
    if (!chunks[i - 1].empty() && !chunks[i].empty() && chunks[i - 1].back() > chunks[i].front()) {
      chunks[i - 1] = chunks[i - 1].substr(0, chunks[i - 1].size() - 1) + chunks[i].substr(1);
      chunks.erase(chunks.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  return chunks;
}

// A set from its body (text between '[' and ']'). Inside a chunk every character is a member; consecutive chunks
// are joined by a range from the last character of one to the first of the next.
GlobItem parse_set(std::string_view body) {
  GlobItem item;
  std::vector<std::string> chunks;
  if (body.find('-') == std::string_view::npos) {
    chunks.emplace_back(body);
  } else {
    chunks = split_set_chunks(body);
  }
  std::string joined;
  for (const std::string& chunk : chunks) joined += chunk;
  if (joined.empty()) {
    item.kind = GlobItem::Kind::kNever;
    return item;
  }
  if (joined == "!") {
    item.kind = GlobItem::Kind::kAnyChar;
    return item;
  }
  item.negate = joined[0] == '!';
  if (item.negate) chunks[0].erase(0, 1);
  for (size_t i = 0; i < chunks.size(); ++i) {
    item.members += chunks[i];
    if (i > 0 && !chunks[i - 1].empty() && !chunks[i].empty()) {
      item.ranges.emplace_back(chunks[i - 1].back(), chunks[i].front());
    }
  }
  return item;
}

std::vector<GlobItem> compile_glob(std::string_view pattern) {
  std::vector<GlobItem> items;
  size_t i = 0;
  while (i < pattern.size()) {
    const char c = pattern[i++];
    if (c == '*') {
      if (items.empty() || items.back().kind != GlobItem::Kind::kStar) items.push_back({GlobItem::Kind::kStar});
    } else if (c == '?') {
      items.push_back({GlobItem::Kind::kAnyChar});
    } else if (c == '[') {
      size_t j = i;
      if (j < pattern.size() && pattern[j] == '!') ++j;
      if (j < pattern.size() && pattern[j] == ']') ++j;
      while (j < pattern.size() && pattern[j] != ']') ++j;
      if (j >= pattern.size()) {
        items.push_back(literal_item('['));
      } else {
        items.push_back(parse_set(pattern.substr(i, j - i)));
        i = j + 1;
      }
    } else {
      items.push_back(literal_item(c));
    }
  }
  return items;
}

}  // namespace

bool quant_fnmatch(std::string_view name, std::string_view pattern) {
  const std::vector<GlobItem> items = compile_glob(pattern);
  size_t n = 0;
  size_t p = 0;
  size_t star = std::string::npos;
  size_t star_n = 0;
  // Every item but '*' consumes exactly one character, so retrying from the last '*' with one more character
  // absorbed finds a match whenever one exists.
  while (n < name.size()) {
    if (p < items.size() && items[p].kind == GlobItem::Kind::kStar) {
      star = p++;
      star_n = n;
    } else if (p < items.size() && items[p].matches(name[n])) {
      ++p;
      ++n;
    } else if (star != std::string::npos) {
      p = star + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < items.size() && items[p].kind == GlobItem::Kind::kStar) ++p;
  return p == items.size();
}

}  // namespace tern
