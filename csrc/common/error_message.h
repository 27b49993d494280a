// Error messages for TORCH_CHECK, built with std::to_string and appends instead of iostreams.
//
// Why: on the GPU image (g++ 13.3 against torch 2.11) an std::ostringstream formatted inside this
// extension crashed the process (SIGSEGV) whenever a TORCH_CHECK message held a number, while
// messages made only of strings raised normally. A single std::string argument makes c10::str
// return it as is, so no stream is ever created on our side.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace flashmod {
namespace detail {

inline void append(std::string& s, const char* x) {
  s += x;
}
inline void append(std::string& s, const std::string& x) {
  s += x;
}
inline void append(std::string& s, const c10::Device& d) {
  s += d.str();
}

// Python's spelling ("torch.float32"), so messages read the same from eager and compiled code.
inline void append(std::string& s, c10::ScalarType t) {
  s += "torch.";
  s += c10::getDtypeNames(t).first;
}

template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
void append(std::string& s, T x) {
  s += std::to_string(x);
}

inline void append(std::string& s, double x) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", x);
  s += buffer;
}

inline void append(std::string& s, c10::IntArrayRef sizes) {
  s += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  s += ']';
}

}  // namespace detail

template <typename... Args>
std::string error_message(const Args&... args) {
  std::string s;
  (detail::append(s, args), ...);
  return s;
}

}  // namespace flashmod
