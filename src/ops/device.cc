#include "ops/device.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <thread>

namespace tern {
namespace {

struct Target {
  int major = 0;
  int minor = 0;
  bool arch_specific = false;  // the "a" suffix
};

// Parses "sm_90a" / "compute_120" (prefix given) into a target.
bool parse_target(std::string_view text, std::string_view prefix, Target& out) {
  if (!text.starts_with(prefix)) return false;
  std::string_view digits = text.substr(prefix.size());
  out.arch_specific = !digits.empty() && digits.back() == 'a';
  if (out.arch_specific) digits.remove_suffix(1);
  if (digits.size() < 2) return false;
  int value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + (c - '0');
  }
  out.major = value / 10;
  out.minor = value % 10;
  return true;
}

bool sass_runs(const Target& t, const DeviceDescription& d) {
  if (t.arch_specific) return t.major == d.cc_major && t.minor == d.cc_minor;
  return t.major == d.cc_major && t.minor <= d.cc_minor;
}

bool ptx_compiles(const Target& t, const DeviceDescription& d) {
  if (t.arch_specific) return t.major == d.cc_major && t.minor == d.cc_minor;
  return d.cc_major * 10 + d.cc_minor >= t.major * 10 + t.minor;
}

}  // namespace

std::string DeviceDescription::arch() const {
  if (backend == Backend::kCpu) return "cpu";
  return fmt::format("sm_{}{}", cc_major, cc_minor);
}

ArchFeatures arch_features(int cc_major, int cc_minor) {
  ArchFeatures f;
  const int cc = cc_major * 10 + cc_minor;
  switch (cc) {
    case 80: case 86: case 87:
      f.mma_bf16 = true;
      break;
    case 89:
      f.mma_bf16 = f.fp8_mma = true;
      break;
    case 90:
      f.mma_bf16 = f.fp8_mma = f.wgmma = f.tma = true;
      break;
    case 100: case 101: case 103:
      f.mma_bf16 = f.fp8_mma = f.tma = f.tcgen05 = f.fp4_block_scaled_mma = true;
      break;
    case 120: case 121:
      f.mma_bf16 = f.fp8_mma = f.tma = f.fp4_block_scaled_mma = true;
      break;
    default:
      break;  // unknown: portable kernels only
  }
  return f;
}

std::string binary_can_run(const BinaryImage& image, const DeviceDescription& device) {
  if (device.backend != Backend::kCuda) return "not a CUDA device";
  for (const std::string& s : image.sass) {
    Target t;
    if (parse_target(s, "sm_", t) && sass_runs(t, device)) return "";
  }
  for (const std::string& p : image.ptx) {
    Target t;
    if (parse_target(p, "compute_", t) && ptx_compiles(t, device)) return "";
  }
  return fmt::format("this binary has no machine code for {} (it holds SASS [{}], PTX [{}])", device.arch(),
                     fmt::join(image.sass, ", "), fmt::join(image.ptx, ", "));
}

Expected<DeviceDescription> simulated_device(std::string_view name) {
  DeviceDescription d;
  if (name == "h200") {  // NVIDIA H200 SXM: sm_90, 227 KiB usable per block
    d = {Backend::kCuda, "NVIDIA H200 (simulated)", 9, 0, 132, 232448, 233472, 65536, 65536, 60 << 20,
         int64_t{143771} << 20, true};
  } else if (name == "b200") {  // NVIDIA B200: sm_100, 227 KiB per block
    d = {Backend::kCuda, "NVIDIA B200 (simulated)", 10, 0, 148, 232448, 233472, 65536, 65536, 126 << 20,
         int64_t{183359} << 20, true};
  } else if (name == "rtx-pro-6000") {  // RTX PRO 6000 Blackwell: sm_120, 99 KiB per block
    d = {Backend::kCuda, "NVIDIA RTX PRO 6000 Blackwell (simulated)", 12, 0, 188, 101376, 102400, 65536, 65536,
         128 << 20, int64_t{97887} << 20, true};
  } else if (name == "rtx-4090") {  // GeForce RTX 4090: sm_89, 99 KiB per block
    d = {Backend::kCuda, "NVIDIA GeForce RTX 4090 (simulated)", 8, 9, 128, 101376, 102400, 65536, 65536, 72 << 20,
         int64_t{24564} << 20, true};
  } else {
    return make_error("unknown simulated device '{}' (known: {})", name, fmt::join(simulated_device_names(), ", "));
  }
  return d;
}

std::vector<std::string> simulated_device_names() { return {"h200", "b200", "rtx-pro-6000", "rtx-4090"}; }

DeviceDescription cpu_device_describe() {
  DeviceDescription d;
  d.backend = Backend::kCpu;
  d.name = "CPU";
  d.sm_count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return d;
}

}  // namespace tern
