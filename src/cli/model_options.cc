#include "cli/model_options.h"

#include <fmt/format.h>

#include <charconv>

namespace tern {

void add_model_options(CLI::App& cmd, ModelCliOptions& o) {
  cmd.add_option("--model", o.model_dir, "Checkpoint directory (config.json + safetensors)")->required();
  cmd.add_option("--load-format", o.load_format, "auto: the checkpoint's weights; dummy: random weights from config.json")
      ->check(CLI::IsMember({"auto", "dummy"}));
  cmd.add_option("--nvfp4-activations", o.nvfp4_activations,
                 "NVFP4 layers: dequantize (W4A16, activations stay fp32) or quantize (W4A4, with input_scale)")
      ->check(CLI::IsMember({"dequantize", "quantize"}));
  cmd.add_option("--device", o.device, "Where to run: cuda, cpu, or auto (cuda when this build has it and a GPU is "
                 "present)")->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd.add_option("--cuda-device", o.cuda_device, "CUDA device ordinal for --device cuda");
  cmd.add_option("--dummy-seed", o.dummy_seed, "Seed of --load-format dummy weights");
}

Expected<std::unique_ptr<CausalLm>> load_model_from_options(const ModelCliOptions& o,
                                                            const DeviceModelOptions& sizes) {
  ModelLoadOptions options;
  const bool cuda = o.device == "cuda" || (o.device == "auto" && model_cuda_device_count() > 0);
  options.device = cuda ? ModelDevice::kCuda : ModelDevice::kCpu;
  options.device_options = sizes;
  options.device_options.device = o.cuda_device;
  options.load_format = o.load_format == "dummy" ? LoadFormat::kDummy : LoadFormat::kAuto;
  options.nvfp4_quantize_activations = o.nvfp4_activations == "quantize";
  options.dummy_seed = o.dummy_seed;
  auto model = model_load(o.model_dir, options);
  if (model) {
    for (const std::string& notice : (*model)->notices) fmt::print(stderr, "{}: {}\n", o.model_dir, notice);
  }
  return model;
}

Expected<std::vector<int32_t>> parse_id_list(const std::string& text) {
  std::vector<int32_t> ids;
  size_t begin = 0;
  while (begin <= text.size()) {
    const size_t end = std::min(text.find(',', begin), text.size());
    const std::string item = text.substr(begin, end - begin);
    int32_t id = 0;
    const auto [ptr, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
    if (item.empty() || ec != std::errc() || ptr != item.data() + item.size() || id < 0) {
      return make_error("--prompt-ids: '{}' is not a token id (expected non-negative integers like 1,2,3)", item);
    }
    ids.push_back(id);
    begin = end + 1;
  }
  return ids;
}

}  // namespace tern
