// What this binary is and what it was built from, so that "is the fix in my build?" is answered by the binary itself:
// `tern --version`, the top of `tern doctor`, the first line `tern serve` logs. The facts are written at build time
// (cmake/BuildInfo.cmake); the libraries found at run time are passed in by the caller, because core has no CUDA
// dependency (kernels/cuda/library_versions.h reads them in a CUDA build).
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace tern {

struct BuildInfo {
  std::string_view version;       // project(VERSION) of CMakeLists.txt: "0.1.0"
  std::string_view commit;        // short git hash, "-dirty" with uncommitted changes; "unknown" built outside git
  std::string_view build_type;    // CMAKE_BUILD_TYPE: "RelWithDebInfo"
  std::string_view compiler;      // the C++ compiler: "GNU 12.2.0"
  bool cuda = false;              // whether the CUDA kernels are compiled in
  std::string_view cuda_toolkit;  // the toolkit they were compiled with, "13.0.88"; empty without CUDA
  std::vector<std::string> cuda_architectures;  // from CMAKE_CUDA_ARCHITECTURES: "sm_90a", ...; empty without CUDA
};

const BuildInfo& build_info();

// A library the process runs with whose version decides which kernels run (the CUDA runtime and driver, cuBLASLt;
// NCCL once tern links it).
struct LibraryVersion {
  std::string key;       // JSON key: "cublaslt"
  std::string name;      // for people: "cuBLASLt"
  std::string version;   // found at run time; empty: none found (no CUDA driver)
  std::string compiled;  // the headers tern was compiled against; empty where that does not apply (the driver)
};

// `tern --version`: "tern 0.1.0" and one indented "name  value" line per fact, without a final newline.
std::string build_info_text(const std::vector<LibraryVersion>& libraries);
// The same on one line, for a log.
std::string build_info_line(const std::vector<LibraryVersion>& libraries);

}  // namespace tern
