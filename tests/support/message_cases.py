"""Cases of the calls that move messages between pairs of ranks, for any group that serves
them (tests/collectives/test_p2p.py on shm, test_fused_p2p.py on the fused engine): ring
exchanges with batch_isend_irecv, all-to-all with even, uneven and empty splits, and gather,
scatter and reduce to every root, each checked on every rank against the inputs every rank
rebuilds (collective_cases.make_input).
"""

from __future__ import annotations

from typing import List

import torch

import pyddp
from collective_cases import check_equal, dtype_op_pairs, make_input, reference_reduce


def ring_exchanges(pg, n: int, r: int, dtypes, counts) -> None:
    """Each rank sends to its right neighbour and receives from its left, in one
    batch_isend_irecv, with the receive posted first or last."""
    right, left = (r + 1) % n, (r - 1) % n
    for dtype in dtypes:
        for count in counts:
            for recv_first in (False, True):
                mine = make_input(r, count, dtype, salt=recv_first)
                got = torch.full((count,), 3, dtype=dtype)
                ops = [pyddp.P2POp(pyddp.isend, mine, right, pg),
                       pyddp.P2POp(pyddp.irecv, got, left, pg)]
                for work in pyddp.batch_isend_irecv(ops[::-1] if recv_first else ops):
                    work.wait()
                check_equal(got, make_input(left, count, dtype, salt=recv_first),
                            f"ring exchange {dtype} count={count} recv_first={recv_first}")


def splits(n: int, case: str) -> List[List[int]]:
    """split[s][d]: rows rank s sends to rank d."""
    if case == "even":
        return [[3] * n for _ in range(n)]
    if case == "uneven":
        return [[(s * 7 + d * 3) % 5 for d in range(n)] for s in range(n)]
    return [[0 if (s + d) % 2 else s + d + 1 for d in range(n)] for s in range(n)]  # zeros


def all_to_all(pg, n: int, r: int) -> None:
    """all_to_all_single (twice each) and all_to_all over lists, every split case."""
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for case in ("even", "uneven", "zeros"):
            split = splits(n, case)
            # rows of 2 elements; block (s -> d) is a function of s and d
            blocks = {(s, d): make_input(s, 2 * split[s][d], dtype, salt=d).reshape(-1, 2)
                      for s in range(n) for d in range(n)}
            inp = torch.cat([blocks[(r, d)] for d in range(n)])
            expected = torch.cat([blocks[(s, r)] for s in range(n)])
            for rep in range(2):
                out = torch.full_like(expected, 9)
                if case == "even":
                    pg.all_to_all_single(out, inp)
                else:
                    pg.all_to_all_single(out, inp, [split[s][r] for s in range(n)], split[r])
                check_equal(out, expected, f"all_to_all_single {dtype} {case} rep={rep}")
            outs = [torch.full_like(blocks[(s, r)], 9) for s in range(n)]
            pg.all_to_all(outs, [blocks[(r, d)] for d in range(n)])
            for s in range(n):
                check_equal(outs[s], blocks[(s, r)], f"all_to_all {dtype} {case} from {s}")


def rooted(pg, n: int, r: int, dtypes, counts, reduce_counts) -> None:
    """gather and scatter of `dtypes` x `counts`, and reduce of every dtype and op x
    `reduce_counts`, to every root; a reduce leaves the other ranks' tensors as they were."""
    for root in range(n):
        for count in counts:
            for dtype in dtypes:
                inputs = [make_input(k, count, dtype, salt=root) for k in range(n)]
                gathered = [torch.full((count,), 7, dtype=dtype) for _ in range(n)]
                pg.gather(inputs[r].clone(), gathered if r == root else None, root)
                if r == root:
                    for k in range(n):
                        check_equal(gathered[k], inputs[k], f"gather {dtype} {count} root={root}")
                out = torch.full((count,), 7, dtype=dtype)
                pg.scatter(out, [t.clone() for t in inputs] if r == root else None, root)
                check_equal(out, inputs[r], f"scatter {dtype} {count} root={root}")
        for dtype, op in dtype_op_pairs():
            for count in reduce_counts:
                inputs = [make_input(k, count, dtype, op, salt=root) for k in range(n)]
                t = inputs[r].clone()
                pg.reduce(t, root, op)
                expected = reference_reduce(inputs, op) if r == root else inputs[r]
                check_equal(t, expected, f"reduce {dtype} {op} {count} root={root}")
