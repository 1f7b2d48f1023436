"""Eviction policies for the fs tier, measured on request traces: LRU (the tier's own) against
ARC, a frequency-aware admission and a chain-position-aware eviction.

    python bench/eviction_policies.py --json /tmp/policies.json
    python bench/eviction_policies.py --trace my_trace.jsonl

A model, not the tiers' code: the primary tier (LRU, 1% of each trace's distinct blocks) in
front of an fs tier whose policy is swapped, each request taking the cache's steps (lookup of
its chain, load of the found prefix, promoted into the primary tier, store of the rest,
written through). Its LRU row is checked against `kvtier replay --sweep`, which runs the
tiers' own code: the model is only trusted where they agree (they differ most at small
capacities, where the fs tier's whole slabs round the capacity down). Capacities: 1% to 40% of each
trace's distinct blocks. Traces: the shared Mooncake trace and three generated ones (with a
seed each; none tuned to any policy):

- `conversations`: multi-turn chats over a few shared system prompts (chains that grow);
- `documents`: many requests over a Zipf-popular set of long documents, each with a
  question of its own (a long shared head, a short private tail);
- `one-off`: 60% of the blocks are seen once (as in real traces), the rest a Zipf mix of
  shared prefixes.

The policies, for the fs tier only:

- `lru`: the least recently used block goes (what the tier does);
- `arc`: Megiddo and Modha's adaptive replacement cache (recency and frequency lists, with
  ghosts of each steering the split);
- `admit-freq`: LRU, but a new block is admitted only if it has been asked for at least as
  often (counts halved every 10x capacity requests) as the block it would evict (TinyLFU's
  idea, exact counts);
- `chain-pos`: of the 8 least recently used blocks, the one deepest in its chain goes (heads
  of chains are shared by more requests than their tails).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier_async.sweep import capacity_for_fraction, simulate
from kvtier_async.trace import Request, read_trace

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
BLOCK = 256 << 10
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.4)


# -- the fs tier's policies ---------------------------------------------------------------------
class Lru:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, int] = OrderedDict()  # id -> chain position

    def __contains__(self, block: int) -> bool:
        return block in self.blocks

    def read(self, block: int) -> None:
        self.blocks.move_to_end(block)

    def victim(self) -> int:
        return next(iter(self.blocks))

    def write(self, block: int, position: int) -> None:
        if len(self.blocks) >= self.capacity:
            del self.blocks[self.victim()]
        self.blocks[block] = position


class ChainPosition(Lru):
    SAMPLE = 8

    def victim(self) -> int:
        oldest = []
        for block in self.blocks:
            oldest.append(block)
            if len(oldest) == self.SAMPLE:
                break
        return max(oldest, key=lambda b: self.blocks[b])


class AdmitByFrequency(Lru):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.asked: Counter[int] = Counter()
        self.events = 0

    def note_asked(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.asked[block] += 1
            self.events += 1
        if self.events >= 10 * self.capacity:  # age the counts
            self.asked = Counter({b: n // 2 for b, n in self.asked.items() if n // 2})
            self.events = 0

    def write(self, block: int, position: int) -> None:
        if len(self.blocks) >= self.capacity and self.asked[block] < self.asked[self.victim()]:
            return  # not admitted: the block it would evict is asked for more
        super().write(block, position)


class Arc:
    def __init__(self, capacity: int) -> None:
        self.c = capacity
        self.p = 0.0
        self.t1: OrderedDict[int, None] = OrderedDict()
        self.t2: OrderedDict[int, None] = OrderedDict()
        self.b1: OrderedDict[int, None] = OrderedDict()
        self.b2: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self.t1 or block in self.t2

    def read(self, block: int) -> None:
        if block in self.t1:
            del self.t1[block]
        else:
            del self.t2[block]
        self.t2[block] = None

    def _replace(self, in_b2: bool) -> None:
        if self.t1 and (len(self.t1) > self.p or (in_b2 and len(self.t1) == self.p)):
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None
        elif self.t2:
            old, _ = self.t2.popitem(last=False)
            self.b2[old] = None
        elif self.t1:
            old, _ = self.t1.popitem(last=False)
            self.b1[old] = None

    def write(self, block: int, position: int) -> None:
        if block in self:
            return
        if block in self.b1:
            self.p = min(self.c, self.p + max(1.0, len(self.b2) / max(1, len(self.b1))))
            self._replace(False)
            del self.b1[block]
            self.t2[block] = None
            return
        if block in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / max(1, len(self.b2))))
            self._replace(True)
            del self.b2[block]
            self.t2[block] = None
            return
        if len(self.t1) + len(self.b1) == self.c:
            if len(self.t1) < self.c:
                self.b1.popitem(last=False)
                self._replace(False)
            else:
                self.t1.popitem(last=False)
        elif len(self.t1) + len(self.b1) < self.c:
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if total >= self.c:
                if total == 2 * self.c:
                    self.b2.popitem(last=False)
                self._replace(False)
        self.t1[block] = None


POLICIES = {"lru": Lru, "arc": Arc, "admit-freq": AdmitByFrequency, "chain-pos": ChainPosition}


# -- the model of the cache ------------------------------------------------------------------------
def hit_rate(requests: list[Request], policy: Any, primary_blocks: int) -> float:
    """Leading blocks found per block asked, through an LRU primary tier and `policy` behind it."""
    primary: OrderedDict[int, None] = OrderedDict()

    def into_primary(block: int) -> None:
        primary[block] = None
        primary.move_to_end(block)
        if len(primary) > primary_blocks:
            primary.popitem(last=False)

    asked = hits = 0
    for request in requests:
        chain = request.hash_ids
        if isinstance(policy, AdmitByFrequency):
            policy.note_asked(chain)
        found = 0
        while found < len(chain) and (chain[found] in primary or chain[found] in policy):
            found += 1
        loaded = 0
        for block in chain[:found]:
            if block in primary:
                primary.move_to_end(block)
            elif block in policy:
                policy.read(block)
                into_primary(block)
            else:
                break  # pushed out of the primary tier by this load's own promotions
            loaded += 1
        for position, block in enumerate(chain[loaded:], start=loaded):
            if block not in primary:
                into_primary(block)
                if block not in policy:
                    policy.write(block, position)
        asked += len(chain)
        hits += loaded
    return hits / max(1, asked)


# -- traces ----------------------------------------------------------------------------------------
def _request(ms: float, chain: list[int]) -> Request:
    return Request(0, ms, 512 * len(chain), 1, tuple(chain))


def conversations(seed: int, n: int = 4000) -> list[Request]:
    rng = random.Random(seed)
    next_id, chats, out = 1 << 40, [], []
    prompts = [list(range(p * 100, p * 100 + rng.randint(2, 12))) for p in range(8)]
    for t in range(n):
        if chats and rng.random() < 0.7:
            chat = rng.choice(chats[-200:])
        else:
            chat = list(rng.choice(prompts))
            chats.append(chat)
        turn = rng.randint(1, 6)
        chat.extend(range(next_id, next_id + turn))
        next_id += turn
        out.append(_request(t, list(chat)))
    return out


def documents(seed: int, n: int = 4000, docs: int = 400) -> list[Request]:
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.1 for k in range(docs)]
    bodies = [list(range(d * 1000, d * 1000 + rng.randint(8, 60))) for d in range(docs)]
    next_id, out = 1 << 40, []
    for t in range(n):
        body = bodies[rng.choices(range(docs), weights)[0]]
        tail = rng.randint(1, 3)
        out.append(_request(t, body + list(range(next_id, next_id + tail))))
        next_id += tail
    return out


def one_off(seed: int, n: int = 4000) -> list[Request]:
    rng = random.Random(seed)
    shared = [list(range(s * 1000, s * 1000 + rng.randint(4, 40))) for s in range(300)]
    weights = [1 / (k + 1) ** 0.9 for k in range(len(shared))]
    next_id, out = 1 << 40, []
    for t in range(n):
        head: list[int] = []
        if rng.random() < 0.7:  # a shared prefix, or part of one
            whole = shared[rng.choices(range(len(shared)), weights)[0]]
            head = whole[: rng.randint(1, len(whole))]
        fresh = rng.randint(4, 30) if head else rng.randint(10, 60)  # most blocks are seen once
        out.append(_request(t, head + list(range(next_id, next_id + fresh))))
        next_id += fresh
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--generated", type=int, default=4000, help="requests in each generated trace")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    traces = {
        args.trace.stem: read_trace(args.trace),
        "conversations": conversations(args.seed, args.generated),
        "documents": documents(args.seed, args.generated),
        "one-off": one_off(args.seed, args.generated),
    }
    results: dict[str, Any] = {"fractions": list(FRACTIONS), "traces": {}}
    for name, requests in traces.items():
        distinct = len({b for r in requests for b in r.hash_ids})
        primary = max(1, distinct // 100)  # a primary tier of 1%: the fs tier decides from 2% on
        rows: dict[str, list[float]] = {}
        for policy_name, policy in POLICIES.items():
            rows[policy_name] = [
                hit_rate(requests, policy(max(1, round(f * distinct))), primary) for f in FRACTIONS
            ]
        # The model's LRU against the tiers' own code (the sweep), at the same capacities.
        rows["lru (the sweep: the tiers' code)"] = [
            simulate(requests, BLOCK, primary * BLOCK, capacity_for_fraction(requests, BLOCK, f))["hit_rate"]
            for f in FRACTIONS
        ]
        results["traces"][name] = {"distinct_blocks": distinct, "primary_blocks": primary, "hit_rates": rows}
        print(
            f"\n{name}: {len(requests)} requests, {distinct} distinct blocks, primary tier {primary} blocks"
        )
        print(f"{'policy':<34}" + "".join(f"{f:>8.0%}" for f in FRACTIONS))
        for policy_name, rates in rows.items():
            print(f"{policy_name:<34}" + "".join(f"{r:>8.1%}" for r in rates), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
