"""Run by test_rendezvous under torchrun and the legacy launcher."""

import torch

import pyddp

pg = pyddp.init_process_group("shm")  # env:// from the launcher's variables
rank, world = pyddp.get_rank(), pyddp.get_world_size()
t = torch.full((1000,), float(rank + 1))
pyddp.all_reduce(t)
assert torch.equal(t, torch.full((1000,), float(world * (world + 1) // 2))), t[:3]
print(f"rank {rank}/{world} local_rank {pyddp.local_rank()} sum {t[0].item():g}", flush=True)
pyddp.destroy_process_group()
