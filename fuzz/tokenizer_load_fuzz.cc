// libFuzzer target for tokenizer.json: any file must load or give an Error, never a crash or a runaway
// allocation; a tokenizer that loads must encode and decode a few texts, and its byte bound
// (Tokenizer::max_bytes_per_token, which the server uses to refuse long prompts before encoding) must hold on
// them: a text of n bytes encodes to at least n / bound tokens.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "tokenizer/tokenizer.h"

namespace {

const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("tern_tokenizer_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto file = scratch() / "tokenizer.json";
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  auto tokenizer = tern::Tokenizer::load(file);
  if (!tokenizer) return 0;
  static const std::string kTexts[] = {
      "Hello world, it's 2025!", "  leading and trailing  ", "\xED\x95\x9C\xEA\xB5\xAD\xEC\x96\xB4 \xE1\x84\x80\xE1\x85\xA1",
      "<|im_start|>user\nhi<|im_end|>", "caf\xC3\xA9 CAF\xC3\x89 \xE2\x84\xAA", std::string(300, 'a'), "\xFF\xFE bad utf8",
  };
  const auto bound = tokenizer->max_bytes_per_token();
  for (const std::string& text : kTexts) {
    const auto ids = tokenizer->encode(text, true);
    (void)tokenizer->decode(ids);
    (void)tokenizer->decode(ids, true);
    if (bound && tokenizer->encode(text).size() * *bound < text.size()) {
      std::fprintf(stderr, "tokenizer_load_fuzz: '%s' (%zu bytes) encodes to fewer than bytes / %zu tokens\n",
                   text.c_str(), text.size(), *bound);
      std::abort();
    }
  }
  return 0;
}
