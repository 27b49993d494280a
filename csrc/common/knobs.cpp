#include "knobs.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "error_message.h"

namespace flashmod {

bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  if (std::strcmp(v, "1") == 0) return true;
  if (std::strcmp(v, "0") == 0) return false;
  TORCH_CHECK(false, error_message(name, " must be 0 or 1, got '", v, "'"));
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(v, &end, 10);
  TORCH_CHECK(errno == 0 && *end == '\0',
              error_message(name, " must be a whole number, got '", v, "'"));
  return static_cast<int64_t>(value);
}

std::string env_text(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::string(v) : std::string();
}

}  // namespace flashmod
