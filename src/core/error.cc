#include "core/error.h"

#include <cstdio>
#include <cstdlib>

namespace tern {

void check_failed(const char* file, int line, const char* expr, const std::string& message) {
  std::fprintf(stderr, "%s:%d: check failed: %s%s%s\n", file, line, expr, message.empty() ? "" : ": ",
               message.c_str());
  std::abort();
}

}  // namespace tern
