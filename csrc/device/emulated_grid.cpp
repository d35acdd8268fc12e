#include "device/emulated_grid.h"

#include <thread>
#include <vector>

#include "kernels/reduce.h"

namespace pyddp {
namespace device {

void runEmulated(const FusedArgs& a, DataType dtype, RedOp op) {
  const int channels = a.protocol == Protocol::Barrier ? 1 : a.channels;
  kernels::dispatchType(dtype, [&](auto t) {
    kernels::dispatchOp(op, [&](auto o) {
      using T = decltype(t);
      using Op = decltype(o);
      std::vector<std::thread> threads;
      threads.reserve(channels);
      try {
        for (int c = 0; c < channels; ++c) {
          threads.emplace_back([&a, c] {
            int shared = 0;
            runChannel<T, Op>(a, c, Team{0, 1}, &shared);
          });
        }
      } catch (...) {
        // A channel that could not start: this rank gives up, so that the
        // channels that did (and the peers) stop waiting for it.
        giveUp(a, encodeError(kAborted, a.rank));
        for (auto& thread : threads) thread.join();
        throw;
      }
      for (auto& thread : threads) thread.join();
    });
  });
}

} // namespace device
} // namespace pyddp
