// The one entry of csrc/testing/ that bindings.cpp calls: adds the
// _testing submodule to pyddp._C (builds with PYDDP_WITH_TESTING).
#pragma once

#include <pybind11/pybind11.h>

namespace pyddp {
namespace testing {

void bindTesting(pybind11::module_& m);

} // namespace testing
} // namespace pyddp
