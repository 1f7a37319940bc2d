"""How few integer ops could decode a 32-bit word of 8 E2M1 codes, were its bits stored in another order?

Why. The decode kernels spend most of their issue slots turning codes into operands: the MMA kernels
(2-32 rows) into bf16 pairs, the one-row GEMV into fp16 pairs (kernels/fp4_decode.py, kernels/gemv.py).
nvfp4.interleave could store each word's 32 bits in any order, and both decodes read that one order.
This script counts, in a simple model, what each decode would cost in every order of one family, so
that an order is built only where the count pays (kernels/README.md has the measured rates).

The model. A value is a sign bit s and three magnitude bits m, m+1, m+2 (mod 32). A decode fills 4
registers, each with one value in its low lane (magnitude at bits t..t+2, sign at 15) and one in its
high lane (t+16.., 31); t = 6 for bf16 (the value e2m1·2^-126) and 9 for fp16 (e2m1·2^-14). A bit
reaches its place through a rotation of the word, one instruction for each distinct non-zero amount;
a register costs one op for each distinct rotation it takes bits from (the first an and with a mask,
each further one a lop3 (a & M) | b). The decode's cost is the sum. Prmt and masks shared between
registers are outside the model, which is why it counts today's storage (byte i: the low nibble's
magnitude at 8i, its sign at 8i + 3, the high nibble's at 8i + 4 and 8i + 7) at 15 ops for either
decode where the kernels take 13.

The family. Twin storages: value j's bits 16 above value i's (mod 32), in 4 such pairs, so that one
rotation can serve both lanes of a register. All of them: the tilings of Z16 by 4 shapes {s, m, m+1,
m+2}, each shape's sign and magnitude each placed in either half. Prints today's cost (its values
paired as suits each decode best), then, for every fp16 cost up to --max-fp16, the least bf16 cost
among twin storages and one that has it. A count here is a guide, not a bound: the real decodes of a
storage may find tricks the model lacks, as today's do.

    python bench/e2m1_orders.py              # ~20 seconds on one CPU core
"""
import argparse
import itertools

BF16, FP16 = 6, 9                          # where each format wants the lowest magnitude bit


def cost(values, t, pairs):
    """Ops to decode values [(s, m)] into format t, the registers holding the given pairs of value
    indices, each pair in its best lane order (the x operand is loaded in the matching order)."""
    best = None
    for lanes in itertools.product((0, 1), repeat=len(pairs)):
        moves, ops = set(), 0
        for (a, b), flip in zip(pairs, lanes):
            lo, hi = values[b if flip else a], values[a if flip else b]
            need = {(t - lo[1]) % 32, (15 - lo[0]) % 32, (t + 16 - hi[1]) % 32, (31 - hi[0]) % 32}
            ops += len(need)
            moves |= need
        total = ops + len(moves - {0})
        best = total if best is None else min(best, total)
    return best


def matchings(items):
    """Every way to pair up the value indices items (the registers' contents)."""
    if not items:
        yield []
        return
    for i in range(1, len(items)):
        for rest in matchings(items[1:i] + items[i + 1:]):
            yield [(items[0], items[i])] + rest


def tilings(free, shapes):
    """Every partition of the bit positions `free` (mod 16) into shapes {s, m, m+1, m+2}."""
    if not free:
        yield tuple(sorted(shapes))
        return
    p = min(free)
    for m in range(16):
        mag = {m, (m + 1) % 16, (m + 2) % 16}
        if mag <= free:
            for s in free - mag:
                if p in mag | {s}:
                    yield from tilings(free - mag - {s}, shapes + [(s, m)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-fp16", type=int, default=12)
    args = ap.parse_args()
    today = [(8 * i + 3, 8 * i) for i in range(4)] + [(8 * i + 7, 8 * i + 4) for i in range(4)]
    least = {t: min(cost(today, t, pairs) for pairs in matchings(list(range(8)))) for t in (BF16, FP16)}
    print(f"today's storage, its best pairs: bf16 {least[BF16]}, fp16 {least[FP16]} ops")
    twins = [(0, 1), (2, 3), (4, 5), (6, 7)]
    best = {}                                                     # fp16 cost -> (bf16 cost, storage)
    for shapes in set(tilings(frozenset(range(16)), [])):
        for halves in itertools.product(range(4), repeat=4):      # sign and magnitude: low or high half
            values = []
            for (s, m), h in zip(shapes, halves):
                s, m = s + 16 * (h & 1), m + 16 * (h >> 1)
                values += [(s, m), ((s + 16) % 32, (m + 16) % 32)]
            f = cost(values, FP16, twins)
            if f <= args.max_fp16:
                b = cost(values, BF16, twins)
                if f not in best or b < best[f][0]:
                    best[f] = (b, values)
    for f in sorted(best):
        b, values = best[f]
        print(f"fp16 {f} ops, bf16 {b} ops: (sign, lowest magnitude bit) of each value {values}")


if __name__ == "__main__":
    main()
