"""pyddp's main job: train a small CNN on handwritten digits across processes.

    torchrun --nproc-per-node 2 examples/train.py     # torchrun starts the ranks
    python examples/train.py                          # starts 2 ranks itself
    python examples/train.py --nproc 1                # one process, no DDP: the reference
    python examples/train.py --device cuda            # the same on GPUs
    torchrun --nproc-per-node 2 --max-restarts 2 examples/train.py --checkpoint DIR
                                                      # survives a rank's death
    python examples/train.py --nproc 3 --survive --kill-rank 2 --kill-at 100
                                                      # ... without a restart

The data set is scikit-learn's 8x8 digits (1797 images, shipped with
scikit-learn, no download). Every rank takes its share of each global batch,
``pyddp.DistributedDataParallel`` averages the gradients, so N ranks train
exactly the model one process would with the same global batch. Rank 0 shows
a progress bar and, per epoch, the loss, test accuracy, samples/s, and the
share of step time spent waiting for gradient all-reduces at the end of
backward (communication that backward did not hide).

With ``--checkpoint DIR`` rank 0 saves the model, the optimizer and the
position in training every ``--checkpoint-every`` steps (written to a
temporary file, then renamed: a checkpoint is whole or absent), and every
rank resumes from it at start. When a rank dies, pyddp makes the others fail
at once naming it; torchrun (``--max-restarts``) starts them all again, and
they go on from the last checkpoint to the model an uninterrupted run makes.

``--device`` says where the model, the data and the optimizer's state live:
``cpu`` (the default), ``cuda`` or ``auto`` (``cuda`` where torch sees a GPU
and pyddp can carry CUDA tensors between the ranks, else ``cpu``). On
``cuda``, rank r takes GPU ``LOCAL_RANK % torch.cuda.device_count()`` (its
rank when this script starts the ranks), so ranks share GPUs round-robin
when there are fewer GPUs than ranks, and the ranks meet in a pyddp group of
backend "auto", which serves CUDA tensors (``pyddp.devices``). ``--device
cuda`` where CUDA cannot serve the job fails before any rank starts, saying
why. A checkpoint saved on one device loads on the other.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import signal
import sys
import time
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from pyddp import devices
from pyddp._launch import Job, LaunchError, RankFailed, Rendezvous, spawn

TIMEOUT_S = 300
"""Bound on a whole run of the spawned ranks: the default 15 epochs, start-up included,
take about a minute on a loaded 2-core machine."""

CHECKPOINT_FILE = "checkpoint.pt"


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a pool and two linear layers (about 75k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_digits(seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train images, train labels, test images, test labels); the same 20% held out everywhere."""
    from sklearn.datasets import load_digits as sklearn_digits

    data = sklearn_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test, train = order[: len(order) // 5], order[len(order) // 5:]
    return images[train], labels[train], images[test], labels[test]


def train(rank: int, world_size: int, args: argparse.Namespace, device: torch.device,
          local_world_size: int, join: Optional[str] = None) -> float:
    """Trains on this rank, on ``device``; returns the final test accuracy (the same on every
    rank). ``local_world_size``: the ranks on this rank's host. With ``--survive`` the group
    may shrink and grow while it trains (``rank`` and ``world_size`` are the start's); the
    standby replacement passes the job's init method as ``join``, with ``rank`` -1: with
    its data and model ready it waits to be called (_called_to_replace), then joins."""
    import pyddp
    from pyddp.ddp import DistributedDataParallel

    torch.set_num_threads(1)  # one core per rank on a small machine
    torch.manual_seed(args.seed)
    replacement = rank < 0
    x_train, y_train, x_test, y_test = (t.to(device) for t in load_digits(args.seed))
    # Initialised on the CPU, then moved: every device starts from the same parameters.
    model: nn.Module = DigitsCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ddp: Optional[DistributedDataParallel] = None
    if join is not None:
        if not _called_to_replace(join):
            return 0.0
        pyddp.join(join, backend=devices.GROUP_BACKEND[args.device])
    if world_size > 1 or join is not None:
        ddp = DistributedDataParallel(model, on_rank_failure="shrink" if args.survive else
                                      "raise", optimizer=optimizer)
        model = ddp
    done = _resume(args.checkpoint, model, optimizer, device)
    steps = len(y_train) // args.batch_size
    # The position in training: steps applied (with --survive, as the group agreed: a
    # process that joins receives it).
    position = (lambda: ddp.committed_steps + done) if args.survive else None
    show = rank == 0
    if show:
        where = ("" if device.type == "cpu" else
                 f", on {device.type} ({torch.cuda.device_count()} GPU(s), "
                 f"{torch.cuda.get_device_name(device)})")
        print(f"digits: {len(y_train)} train / {len(y_test)} test images; {world_size} "
              f"rank(s), global batch {args.batch_size}, "
              f"{sum(p.numel() for p in model.parameters())} parameters{where}", flush=True)
        note = (devices.sharing_note(local_world_size, torch.cuda.device_count())
                if device.type == "cuda" else None)
        if note:
            print(note, flush=True)
        if done:
            print(f"resumed from {args.checkpoint} after {done} steps", flush=True)
    bar = _progress(show, args.epochs * steps)
    if bar is not None:
        bar.update(done)
    accuracy = 0.0
    finished = done if position is None else position()
    while finished < args.epochs * steps:
        epoch = finished // steps
        # Every rank draws the same permutation and takes its share of each global batch.
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(
            args.seed * 1000 + epoch)).to(device)
        model.train()
        loss_sum, samples, comm_wait, start = 0.0, 0, 0.0, time.perf_counter()
        first = finished
        while finished < (epoch + 1) * steps:
            if args.survive:
                if ddp.admit() and ddp.process_group.rank() == 0:
                    _write(bar, f"step {finished + 1}: a process joined; going on with "
                                f"{ddp.process_group.size()} ranks")
                if finished == args.kill_at and ddp.process_group.rank() == args.kill_rank \
                        and not replacement:
                    os.kill(os.getpid(), signal.SIGKILL)  # the demonstration's lost rank
            rank, world_size = _place(ddp, rank, world_size)
            step = finished - epoch * steps
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            mine = batch[_share(args.batch_size, rank, world_size)]
            # The mean over the global batch, whatever each rank's share: the sum of this
            # rank's losses / the global batch, times the ranks DDP averages over.
            loss = F.cross_entropy(model(x_train[mine]), y_train[mine], reduction="sum")
            (loss * world_size / args.batch_size).backward()
            applied = ddp.should_commit() if args.survive else True
            if applied:
                optimizer.step()
            optimizer.zero_grad()
            if args.survive and ddp.process_group.size() < world_size \
                    and ddp.process_group.rank() == 0:
                _write(bar, f"step {finished + 1}: a rank was lost; going on with "
                            f"{ddp.process_group.size()} rank(s)"
                            f"{'' if applied else ', the step done again'}")
            if not applied:
                continue
            if ddp is not None:
                comm_wait += ddp.last_comm_wait_seconds
            loss_sum += loss.item()
            samples += len(mine)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss.item() / len(mine):.3f}")
            finished = finished + 1 if position is None else position()
            if args.checkpoint and rank == 0 and finished % args.checkpoint_every == 0:
                _save(args.checkpoint, model, optimizer, finished)
        elapsed = time.perf_counter() - start
        rank, world_size = _place(ddp, rank, world_size)
        loss_sum, samples = _sum_over_ranks(torch.tensor([loss_sum, samples],
                                                         dtype=torch.float64), world_size)
        accuracy = _test_accuracy(model, x_test, y_test, rank, world_size)
        if rank == 0:
            line = (f"epoch {epoch + 1:2d}/{args.epochs}  loss {loss_sum / samples:.4f}  "
                    f"test accuracy {100 * accuracy:5.2f}%  "
                    f"{(finished - first) * args.batch_size / elapsed:8.0f} samples/s")
            if ddp is not None:
                line += f"  waiting on communication {100 * comm_wait / elapsed:4.1f}% of step time"
            _write(bar, line)
    if bar is not None:
        bar.close()
    if rank == 0:
        print(f"final test accuracy: {100 * accuracy:.2f}% ({world_size} rank(s))", flush=True)
    if ddp is not None:
        pyddp.destroy_process_group()
    return accuracy


def _place(ddp, rank: int, world_size: int) -> Tuple[int, int]:
    """This rank's rank and the world size now (they change when the group shrinks or
    grows)."""
    if ddp is None:
        return rank, world_size
    return ddp.process_group.rank(), ddp.process_group.size()


def _share(batch_size: int, rank: int, world_size: int) -> slice:
    """Rank ``rank``'s part of a global batch: the ranks' parts differ by at most one."""
    return slice(batch_size * rank // world_size, batch_size * (rank + 1) // world_size)


def _resume(directory: Optional[str], model: nn.Module, optimizer: torch.optim.Optimizer,
            device: torch.device) -> int:
    """Loads the checkpoint in ``directory`` onto ``device`` if there is one, whichever device
    saved it; the steps it had done (0 if none)."""
    if not directory:
        return 0
    path = os.path.join(directory, CHECKPOINT_FILE)
    if not os.path.exists(path):
        return 0
    state = torch.load(path, weights_only=True, map_location=device)
    (model.module if hasattr(model, "module") else model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["steps"])


def _save(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
          steps: int) -> None:
    """Writes the checkpoint of rank 0 so that a reader finds the previous one or this one, whole."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, CHECKPOINT_FILE)
    module = model.module if hasattr(model, "module") else model
    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(),
                "steps": steps}, path + ".tmp")
    os.replace(path + ".tmp", path)


def _test_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int,
                   world_size: int) -> float:
    """Each rank scores its slice of the test set; the counts are summed over ranks."""
    model.eval()
    with torch.no_grad():
        mine = slice(rank, len(y), world_size)
        # Summed on the CPU, as the losses are, whatever the device.
        correct = (model(x[mine]).argmax(1) == y[mine]).sum().to("cpu", torch.float64)
    return _sum_over_ranks(correct, world_size)[0] / len(y)


def _sum_over_ranks(value: torch.Tensor, world_size: int) -> List[float]:
    """``value``'s elements, each summed over the ranks."""
    value = value.reshape(-1).clone()
    if world_size > 1:
        import pyddp

        pyddp.all_reduce(value)
    return value.tolist()


def _progress(show: bool, total: int):
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="step", dynamic_ncols=True, leave=False)


def _write(bar, line: str) -> None:
    if bar is None:
        print(line, flush=True)
    else:
        bar.write(line)


def _rank_device(device_type: str, local_rank: int, local_world_size: int) -> torch.device:
    """This rank's device; on CUDA its GPU (``pyddp.devices.use_gpu``), made current before
    the rank makes its group."""
    if device_type == "cpu":
        return torch.device("cpu")
    return devices.use_gpu(local_rank, local_world_size)


def _spawned_rank(rank: int, world_size: int, init_method: str, args: argparse.Namespace
                  ) -> None:
    import pyddp

    # One host: the rank is the local rank.
    device = _rank_device(args.device, rank, world_size)
    pyddp.init_process_group(devices.GROUP_BACKEND[args.device], init_method=init_method,
                             rank=rank, world_size=world_size)
    train(rank, world_size, args, device, world_size)


# The key on the job's store by which this script calls the standby replacement: "join"
# when a rank has died, "exit" when the job ended without losing one.
STANDBY_KEY = "train.py/standby"


def _called_to_replace(init_method: str) -> bool:
    """Waits until this script calls the standby replacement; whether it is to join."""
    from pyddp.rendezvous import client_store

    store = client_store(init_method, datetime.timedelta(seconds=TIMEOUT_S))
    store.wait([STANDBY_KEY])
    return store.get(STANDBY_KEY) == b"join"


def _standby_rank(_: int, init_method: str, args: argparse.Namespace) -> None:
    train(-1, 0, args, _rank_device(args.device, 0, 1), 1, join=init_method)


def _start_ranks(world_size: int, args: argparse.Namespace) -> int:
    """Starts ``world_size`` ranks that meet through a file:// store; their worst exit code.
    With --survive, a standby process starts beside them, loads what they load and waits:
    it joins them in place of the first rank that dies (as a spare would), and exits when
    none does; the dead rank's exit code does not count."""
    with Rendezvous(prefix="pyddp-train-") as rendezvous, contextlib.ExitStack() as jobs:
        init_method = rendezvous.init_method()
        job = jobs.enter_context(spawn(_spawned_rank, world_size,
                                       (world_size, init_method, args)))
        standby: Optional[Job] = None
        store = None
        if args.survive:
            standby = jobs.enter_context(spawn(_standby_rank, 1, (init_method, args)))
            store = torch.distributed.FileStore(rendezvous.store_path())
        lost: set = set()
        called = False  # whether the standby process was told to join or to exit
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while True:
                try:
                    finished = job.poll(lost)
                except RankFailed as error:
                    if store is None or error.rank is None or called:
                        raise
                    lost.add(error.rank)
                    print(f"train.py: {error}; the standby process joins in its place",
                          flush=True)
                    store.set(STANDBY_KEY, b"join")
                    called = True
                    continue
                if finished and store is not None and not called:
                    store.set(STANDBY_KEY, b"exit")  # the job ended whole
                    called = True
                if finished and (standby is None or standby.poll()):
                    break
                if time.monotonic() > deadline:
                    raise LaunchError(f"the ranks still run after {TIMEOUT_S} s")
                time.sleep(0.05)
        except LaunchError as error:
            print(f"train.py: {error}", file=sys.stderr, flush=True)
            return 1
        codes = [code for rank, code in enumerate(job.exitcodes()) if rank not in lost]
        codes += standby.exitcodes() if standby is not None else []
    return max((code or 0 for code in codes), key=abs)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2,
                        help="ranks to start when not run by torchrun (default 2; 1 trains "
                             "in this process without DDP)")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint", metavar="DIR", default=None,
                        help="save to DIR every --checkpoint-every steps and resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="N")
    parser.add_argument("--survive", action="store_true",
                        help="keep training when a rank dies: the others go on without it "
                             "(pyddp.DistributedDataParallel(on_rank_failure='shrink')) and "
                             "a standby process this script starts joins them in its place "
                             "(not under torchrun, which ends every rank when one fails)")
    parser.add_argument("--kill-rank", type=int, default=None, metavar="R",
                        help="with --survive, for a demonstration: rank R kills itself "
                             "(SIGKILL) at step --kill-at")
    parser.add_argument("--kill-at", type=int, default=None, metavar="STEP")
    parser.add_argument("--device", choices=devices.DEVICE_CHOICES, default="cpu",
                        help="where to train: cpu (default), cuda (rank r on GPU "
                             "LOCAL_RANK %% device count), or auto (cuda where it can "
                             "serve, else cpu)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.survive and (torchrun or args.nproc < 2):
        parser.error("--survive needs 2 or more ranks that this script starts (torchrun ends "
                     "every rank when one fails)")
    if (args.kill_rank is None) != (args.kill_at is None) or (
            args.kill_rank is not None and not args.survive):
        parser.error("--kill-rank and --kill-at go together, with --survive")
    try:
        # Decided before any rank or group starts; the ranks get "cpu" or "cuda".
        ranks = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc
        args.device = devices.resolve(args.device, pyddp_groups=ranks > 1)
    except devices.DeviceUnavailable as error:
        parser.error(str(error))
    if torchrun:
        import pyddp

        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        device = _rank_device(args.device, int(os.environ.get("LOCAL_RANK", "0")),
                              local_world_size)
        pyddp.init_process_group(devices.GROUP_BACKEND[args.device])  # env:// from torchrun
        train(pyddp.get_rank(), pyddp.get_world_size(), args, device, local_world_size)
        return 0
    if args.nproc == 1:
        train(0, 1, args, _rank_device(args.device, 0, 1), 1)
        return 0
    return _start_ranks(args.nproc, args)


if __name__ == "__main__":
    sys.exit(main())
