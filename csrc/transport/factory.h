// The transports this build has, by name: which device each serves and how
// to make one. The engine registry (backend/engine_registry.h) chooses
// among them; nothing else names a transport class.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/config.h"
#include "transport/transport.h"

namespace pyddp {

struct TransportArgs {
  int rank;
  int size;
  GroupOptions options;
  // -1 for the CPU, else the CUDA device index.
  int device;
  // The cudaStream_t every verb of a device transport is enqueued on; the
  // caller owns it and keeps it alive longer than the transport.
  void* stream;
};

// "shm", and in CUDA builds "cuda_ipc" and "nccl".
std::vector<std::string> transportNames();
// "" when `name` can serve these arguments, else why not (a CPU build has
// no CUDA transport; cuda_ipc serves at most 16 ranks; ...). Every rank
// computes the same answer from the same arguments.
std::string whyNotTransport(const std::string& name, const TransportArgs& args);
// A new, unconnected transport (bootstrap.h connects it); throws the
// whyNotTransport() reason as a ValueError.
std::unique_ptr<Transport> makeTransport(const std::string& name, const TransportArgs& args);

} // namespace pyddp
