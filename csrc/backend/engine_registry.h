// Which engine and transport serve a group's tensors of one device. The
// user's backend name ("shm", "cuda_ipc", "nccl", "nccl_ring", "auto")
// selects an ordered list of candidates for the device type, a table in
// engine_registry.cpp; the first candidate that every rank can connect
// wins. For the CPU the candidates see the host map (backend/layout.h):
// shm serves one host, the hierarchical engine several. Every rank sees
// the same refusals (bootstrap exchanges them), so all ranks choose alike.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <string>
#include <vector>

#include "backend/engine.h"
#include "backend/hierarchical_engine.h"
#include "common/config.h"

namespace pyddp {

struct EngineChoice {
  c10::intrusive_ptr<Engine> engine;
  // One line per candidate passed over: "<engine> over <transport>: why".
  std::vector<std::string> refusals;
  // Where the ranks run and how the engine composes (for the log).
  std::string layout;
};

// The backend names this build serves, in the order users are told them.
std::vector<std::string> backendNames();
// Device types ("cpu", "cuda") a group of `backend` serves.
std::vector<std::string> deviceTypesOf(const std::string& backend);

// Makes the engine of `backend` for `device` (the CPU, or cuda:N), trying
// its candidates in order; blocks until every rank has connected (bounded
// by options.timeoutMs). Each candidate meets on its own prefix of `store`.
// `gloo` makes the groups between hosts; without it, CPU groups serve one
// host.
EngineChoice makeEngine(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                        const GroupOptions& options, c10::Device device,
                        const std::string& backend, const CrossHostFactory& gloo = nullptr);

} // namespace pyddp
