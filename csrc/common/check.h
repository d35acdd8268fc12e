// Error reporting for pyddp's C++ core: every check throws (c10::Error and its
// typed subclasses, which torch's bindings turn into Python exceptions); the
// library never exits, aborts or prints.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>
#include <string_view>

// A broken invariant inside pyddp or a failed system call: RuntimeError.
#define PYDDP_CHECK(cond, ...) TORCH_CHECK(cond, "pyddp: ", __VA_ARGS__)
// A bad argument from the caller: ValueError.
#define PYDDP_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE(cond, "pyddp: ", __VA_ARGS__)
// A tensor or option of a kind pyddp does not support: TypeError.
#define PYDDP_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, "pyddp: ", __VA_ARGS__)
// A peer that did not arrive, died, or disagreed: torch.distributed.DistBackendError.
#define PYDDP_CHECK_COMM(cond, ...)                                   \
  if (C10_UNLIKELY_OR_CONST(!(cond))) {                               \
    C10_THROW_ERROR(DistBackendError, ::c10::str("pyddp: ", __VA_ARGS__)); \
  }

namespace pyddp {

// An error's message without the C++ backtrace c10 errors carry: for
// messages that go into other errors and to the peers.
inline std::string messageOf(const std::exception& e) {
  const auto* c10Error = dynamic_cast<const c10::Error*>(&e);
  return c10Error ? c10Error->what_without_backtrace() : e.what();
}

// A message that goes into another pyddp error, without its own "pyddp: ".
inline std::string bare(std::string message) {
  constexpr std::string_view kPrefix = "pyddp: ";
  while (message.rfind(kPrefix, 0) == 0) message.erase(0, kPrefix.size());
  return message;
}

} // namespace pyddp
