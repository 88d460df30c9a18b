#include "core/build_info.h"

#include <gtest/gtest.h>

#include <cctype>
#include <regex>
#include <sstream>
#include <string>

#if TERN_TEST_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace tern {
namespace {

// CMAKE_CUDA_ARCHITECTURES as CMake passed it to this test ("90a,100a-real,...") in the names nvcc gives the code.
std::vector<std::string> expected_architectures() {
  std::vector<std::string> out;
  if (!TERN_TEST_HAVE_CUDA) return out;
  std::istringstream in(TERN_TEST_CUDA_ARCHITECTURES);
  for (std::string arch; std::getline(in, arch, ',');) {
    if (arch.ends_with("-virtual")) {
      out.push_back("compute_" + arch.substr(0, arch.size() - 8));
    } else if (arch.ends_with("-real")) {
      out.push_back("sm_" + arch.substr(0, arch.size() - 5));
    } else {
      out.push_back(!arch.empty() && std::isdigit(static_cast<unsigned char>(arch[0])) ? "sm_" + arch : arch);
    }
  }
  return out;
}

TEST(BuildInfo, VersionIsTheProjectVersion) {
  EXPECT_EQ(build_info().version, std::to_string(TERN_TEST_VERSION_MAJOR) + "." +
                                      std::to_string(TERN_TEST_VERSION_MINOR) + "." +
                                      std::to_string(TERN_TEST_VERSION_PATCH));
}

TEST(BuildInfo, CommitIsAShortHashOrUnknown) {
  const std::string commit(build_info().commit);
  EXPECT_TRUE(std::regex_match(commit, std::regex("[0-9a-f]{7,40}(-dirty)?")) || commit == "unknown") << commit;
}

TEST(BuildInfo, BuildTypeAndCompiler) {
  EXPECT_EQ(build_info().build_type, TERN_TEST_BUILD_TYPE);
  // The compiler that compiled this test, from its own macros (tern builds all of its C++ with one compiler).
#if defined(__clang__)
  const std::string expected = "Clang " + std::to_string(__clang_major__) + "." + std::to_string(__clang_minor__);
#elif defined(__GNUC__)
  const std::string expected = "GNU " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__);
#else
  const std::string expected(build_info().compiler);
#endif
  EXPECT_TRUE(build_info().compiler.starts_with(expected)) << build_info().compiler << " vs " << expected;
}

TEST(BuildInfo, CudaFacts) {
  EXPECT_EQ(build_info().cuda, TERN_TEST_HAVE_CUDA != 0);
  EXPECT_EQ(build_info().cuda_architectures, expected_architectures());
#if TERN_TEST_HAVE_CUDA
  EXPECT_FALSE(build_info().cuda_architectures.empty());
  const std::string toolkit = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
  EXPECT_TRUE(build_info().cuda_toolkit.starts_with(toolkit + ".")) << build_info().cuda_toolkit << " vs " << toolkit;
#else
  EXPECT_EQ(build_info().cuda_toolkit, "");
#endif
}

TEST(BuildInfo, TextHasEveryFact) {
  const std::vector<LibraryVersion> libraries = {{"cublaslt", "cuBLASLt", "13.1.0", "13.0.2"},
                                                 {"cuda_driver", "CUDA driver", "", ""}};
  const std::string text = build_info_text(libraries);
  const BuildInfo& b = build_info();
  EXPECT_TRUE(text.starts_with("tern " + std::string(b.version) + "\n")) << text;
  EXPECT_NE(text.find("  commit             " + std::string(b.commit) + "\n"), std::string::npos) << text;
  EXPECT_NE(text.find("  build type         " + std::string(b.build_type) + "\n"), std::string::npos) << text;
  EXPECT_NE(text.find("  compiler           " + std::string(b.compiler) + "\n"), std::string::npos) << text;
  EXPECT_NE(text.find(b.cuda ? "  CUDA support       yes\n" : "  CUDA support       no"), std::string::npos) << text;
  if (b.cuda) {
    EXPECT_NE(text.find("  GPU architectures  " + b.cuda_architectures[0]), std::string::npos) << text;
  }
  EXPECT_NE(text.find("  cuBLASLt           13.1.0 (compiled against 13.0.2)\n"), std::string::npos) << text;
  EXPECT_TRUE(text.ends_with("  CUDA driver        none found")) << text;

  const std::string line = build_info_line(libraries);
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  EXPECT_TRUE(line.starts_with("tern " + std::string(b.version) + " (commit " + std::string(b.commit) + ", ")) << line;
  EXPECT_TRUE(line.ends_with("; cuBLASLt 13.1.0, CUDA driver none found)")) << line;
}

}  // namespace
}  // namespace tern
