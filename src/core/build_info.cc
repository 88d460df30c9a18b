#include "core/build_info.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sstream>

#include "core/build_info_generated.h"

namespace tern {
namespace {

std::vector<std::string> split_words(std::string_view s) {
  std::vector<std::string> out;
  std::istringstream in{std::string(s)};
  for (std::string word; in >> word;) out.push_back(word);
  return out;
}

std::string library_value(const LibraryVersion& l) {
  std::string out = l.version.empty() ? "none found" : l.version;
  if (!l.compiled.empty()) out += fmt::format(" (compiled against {})", l.compiled);
  return out;
}

}  // namespace

const BuildInfo& build_info() {
  static const BuildInfo info{.version = TERN_BUILD_VERSION,
                              .commit = TERN_BUILD_COMMIT,
                              .build_type = TERN_BUILD_TYPE,
                              .compiler = TERN_BUILD_COMPILER,
                              .cuda = TERN_BUILD_CUDA != 0,
                              .cuda_toolkit = TERN_BUILD_CUDA_TOOLKIT,
                              .cuda_architectures = split_words(TERN_BUILD_CUDA_ARCHITECTURES)};
  return info;
}

std::string build_info_text(const std::vector<LibraryVersion>& libraries) {
  const BuildInfo& b = build_info();
  std::string out = fmt::format("tern {}", b.version);
  auto line = [&out](std::string_view name, std::string_view value) {
    out += fmt::format("\n  {:<18} {}", name, value);
  };
  line("commit", b.commit);
  line("build type", b.build_type);
  line("compiler", b.compiler);
  line("CUDA support", b.cuda ? "yes" : "no (CPU-only build)");
  if (b.cuda) {
    line("CUDA toolkit", b.cuda_toolkit);
    line("GPU architectures", fmt::format("{}", fmt::join(b.cuda_architectures, " ")));
  }
  for (const LibraryVersion& l : libraries) line(l.name, library_value(l));
  return out;
}

std::string build_info_line(const std::vector<LibraryVersion>& libraries) {
  const BuildInfo& b = build_info();
  std::string out = fmt::format("tern {} (commit {}, {}, {}", b.version, b.commit, b.build_type, b.compiler);
  out += b.cuda ? fmt::format("; CUDA {} for {}", b.cuda_toolkit, fmt::join(b.cuda_architectures, " "))
                : std::string("; CPU-only build");
  for (size_t i = 0; i < libraries.size(); ++i) {
    out += fmt::format("{}{} {}", i == 0 ? "; " : ", ", libraries[i].name,
                       libraries[i].version.empty() ? "none found" : libraries[i].version);
  }
  return out + ")";
}

}  // namespace tern
