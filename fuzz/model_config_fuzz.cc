// libFuzzer target for config.json: any document must give a ModelConfig or an Error naming the file, never a
// crash, and an accepted config must have the sizes tern's loaders rely on: positive and within the bounds the
// parser promises (sizes at most 2^24, contexts at most 2^30), so that products of them cannot overflow.
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "core/json_parse.h"
#include "io/model_config.h"

namespace {

void require(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "model_config_fuzz: accepted config breaks an invariant: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto doc = tern::json_parse_untrusted(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!doc) return 0;
  auto config = tern::model_config_parse(*doc, "fuzz/config.json");
  if (!config) {
    require(config.error().message.find("fuzz/config.json") != std::string::npos, "error names the file");
    return 0;
  }
  constexpr int64_t kSize = int64_t{1} << 24;
  for (const int64_t v : {config->hidden_size, config->vocab_size, config->num_hidden_layers,
                          config->num_attention_heads, config->head_dim}) {
    require(v > 0 && v <= kSize, "a size outside (0, 2^24]");
  }
  require(config->num_key_value_heads >= 0 && config->num_key_value_heads <= kSize, "num_key_value_heads");
  require(config->max_position_embeddings >= 0 && config->max_position_embeddings <= (int64_t{1} << 30),
          "max_position_embeddings");
  for (int64_t l = 0; l < config->num_hidden_layers; ++l) (void)config->is_moe_layer(l);
  return 0;
}
