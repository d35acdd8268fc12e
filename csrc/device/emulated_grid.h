// The emulated grid: a fused collective's launch run on the CPU, one
// thread per channel, each running the channel program of programs.h that
// a GPU's thread block runs. Its buffers are shared memory mapped by every
// rank's process (transport/emulated_memory.h), so the barriers, the
// digests, the rounds and the failure paths are the GPU's own, between
// real processes. For the CPU test suite; compiled in every build.
#pragma once

#include "common/types.h"
#include "device/programs.h"

namespace pyddp {
namespace device {

// Runs every channel of `a` to its end (or until it gives up: the error
// word says why) on threads of this process, then returns. Throws, having
// given up and joined the channels it started, if it cannot start one.
void runEmulated(const FusedArgs& a, DataType dtype, RedOp op);

} // namespace device
} // namespace pyddp
