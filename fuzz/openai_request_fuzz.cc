// libFuzzer target for the OpenAI request parser and validator: any body must give an ApiRequest or a 4xx
// ApiError with a message, never a crash (ASan/UBSan watch the parser, the JSON reader and the sampler's checks).
// An accepted request must also survive the max_tokens check against a context, ask for 1..kApiMaxChoices choices
// and, for completions, hold a prompt. The /tokenize and /detokenize bodies go through their parsers too.
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "server/openai_request.h"

namespace {

void check_error(const tern::ApiError& e, std::string_view body) {
  if (e.status < 400 || e.status > 499 || e.message.empty()) {
    std::fprintf(stderr, "openai_request_fuzz: bad error (status %d, message '%s') for %.*s\n", e.status,
                 e.message.c_str(), static_cast<int>(body.size() > 200 ? 200 : body.size()), body.data());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  for (const bool chat : {true, false}) {
    auto parsed = tern::api_request_parse(body, chat);
    if (!parsed) {
      check_error(parsed.error(), body);
      continue;
    }
    if (parsed->chat != chat) std::abort();
    if (parsed->n < 1 || (chat ? 1 : static_cast<int64_t>(parsed->prompts.size())) * parsed->n > tern::kApiMaxChoices) {
      std::abort();
    }
    if (!chat && parsed->prompts.empty()) std::abort();
    for (const int64_t prompt : {int64_t{1}, int64_t{4000}, int64_t{5000}}) {
      auto max_tokens = tern::api_request_max_tokens(*parsed, prompt, 4096);
      if (!max_tokens) check_error(max_tokens.error(), body);
      else if (*max_tokens < 1 || prompt + *max_tokens > 4096) std::abort();
    }
  }
  if (auto t = tern::api_tokenize_parse(body); !t) {
    check_error(t.error(), body);
  } else if (!t->chat && !t->prompt) {
    std::abort();
  }
  if (auto d = tern::api_detokenize_parse(body); !d) check_error(d.error(), body);
  return 0;
}
