// Output formats are relied on by scripts:
//   tern tokenize --tokenizer T --text S               -> "1,2,3"
//   tern tokenize --tokenizer T --input-jsonl F        -> one {"ids": [...]} per input line (a JSON string)
//   tern detokenize --tokenizer T --ids 1,2,3          -> the text
//   tern detokenize --tokenizer T --input-jsonl F      -> one {"text": "..."} per input line ({"ids": [...]})
#include "cli/tokenize_command.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace tern {
namespace {

struct TokenizeOptions {
  std::string tokenizer;
  std::string text;
  std::string ids;
  std::string input_jsonl;
  bool add_special_tokens = false;
  bool skip_special_tokens = false;
};

[[noreturn]] void fail(const std::string& message) {
  std::cerr << "error: " << message << "\n";
  throw CLI::RuntimeError(1);
}

Tokenizer load_or_fail(const std::string& path) {
  auto tokenizer = Tokenizer::load(path);
  if (!tokenizer) fail(tokenizer.error().message);
  return std::move(*tokenizer);
}

// Calls on_line(json, line_number) for each non-empty line of a JSONL file.
template <class F>
void for_each_jsonl(const std::string& path, F&& on_line) {
  std::ifstream in(path);
  if (!in) fail(path + ": cannot open file");
  std::string line;
  for (size_t number = 1; std::getline(in, line); ++number) {
    if (line.empty() || line == "\r") continue;
    try {
      on_line(nlohmann::json::parse(line), number);
    } catch (const nlohmann::json::exception& e) {
      fail(fmt::format("{}:{}: {}", path, number, e.what()));
    }
  }
}

std::vector<int32_t> parse_ids(const std::string& list) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= list.size() && !list.empty()) {
    const size_t comma = std::min(list.find(',', pos), list.size());
    const std::string item = list.substr(pos, comma - pos);
    size_t used = 0;
    long long value = -1;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || value < 0 || value > INT32_MAX) {
      fail(fmt::format("--ids: '{}' is not a token id (expected comma-separated non-negative integers)", item));
    }
    ids.push_back(static_cast<int32_t>(value));
    pos = comma + 1;
  }
  return ids;
}

void run_tokenize(const TokenizeOptions& o) {
  const Tokenizer tokenizer = load_or_fail(o.tokenizer);
  if (o.input_jsonl.empty()) {
    const auto ids = tokenizer.encode(o.text, o.add_special_tokens);
    std::cout << fmt::format("{}\n", fmt::join(ids, ","));
    return;
  }
  for_each_jsonl(o.input_jsonl, [&](const nlohmann::json& line, size_t number) {
    if (!line.is_string()) fail(fmt::format("{}:{}: expected a JSON string", o.input_jsonl, number));
    const nlohmann::json out = {{"ids", tokenizer.encode(line.get<std::string>(), o.add_special_tokens)}};
    std::cout << out.dump() << "\n";
  });
}

void run_detokenize(const TokenizeOptions& o) {
  const Tokenizer tokenizer = load_or_fail(o.tokenizer);
  if (o.input_jsonl.empty()) {
    std::cout << tokenizer.decode(parse_ids(o.ids), o.skip_special_tokens) << "\n";
    return;
  }
  for_each_jsonl(o.input_jsonl, [&](const nlohmann::json& line, size_t number) {
    if (!line.is_object() || !line.contains("ids") || !line["ids"].is_array()) {
      fail(fmt::format("{}:{}: expected {{\"ids\": [...]}}", o.input_jsonl, number));
    }
    const auto ids = line["ids"].get<std::vector<int32_t>>();
    const nlohmann::json out = {{"text", tokenizer.decode(ids, o.skip_special_tokens)}};
    std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  });
}

}  // namespace

void register_tokenize_commands(CLI::App& app) {
  auto options = std::make_shared<TokenizeOptions>();

  CLI::App* tokenize = app.add_subcommand("tokenize", "Encode text to token ids with a tokenizer.json");
  tokenize->add_option("--tokenizer", options->tokenizer, "tokenizer.json or a directory holding it")->required();
  auto* text = tokenize->add_option("--text", options->text, "text to encode; prints comma-separated ids");
  auto* jsonl = tokenize->add_option("--input-jsonl", options->input_jsonl,
                                     "file with one JSON string per line; prints {\"ids\": [...]} per line");
  text->excludes(jsonl);
  tokenize->add_flag("--add-special-tokens", options->add_special_tokens, "apply the post-processor (BOS etc.)");
  tokenize->callback([options, text, jsonl] {
    if (text->count() == 0 && jsonl->count() == 0) fail("tokenize needs --text or --input-jsonl");
    run_tokenize(*options);
  });

  CLI::App* detokenize = app.add_subcommand("detokenize", "Decode token ids to text with a tokenizer.json");
  detokenize->add_option("--tokenizer", options->tokenizer, "tokenizer.json or a directory holding it")->required();
  auto* ids = detokenize->add_option("--ids", options->ids, "comma-separated ids; prints the text");
  auto* ids_jsonl = detokenize->add_option("--input-jsonl", options->input_jsonl,
                                           "file with one {\"ids\": [...]} per line; prints {\"text\": ...} per line");
  ids->excludes(ids_jsonl);
  detokenize->add_flag("--skip-special-tokens", options->skip_special_tokens, "leave special tokens out");
  detokenize->callback([options, ids, ids_jsonl] {
    if (ids->count() == 0 && ids_jsonl->count() == 0) fail("detokenize needs --ids or --input-jsonl");
    run_detokenize(*options);
  });
}

}  // namespace tern
