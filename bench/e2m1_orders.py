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

Programs. Beyond the model, a left shift can be a multiply (IMAD): x·(2^a + 2^b) is (x << a) | (x << b)
wherever the two copies of x's set bits never meet, so that no carry forms; a right shift can be the
high word of one (mul.hi by 2^(32-a)), which ptxas issues as IMAD.HI on the FMA pipe, where it also
puts the multiplies (IMAD) and some left shifts (IMAD.SHL; others SHF, its choice). PROGRAMS
holds the fp16 and bf16 decodes, op by op, of one storage built that way (STORAGE: each half-word
holds four magnitudes at bits 6, 3, 0, 9 and their signs at 12..15, their pairs 16 higher), with the
codes of today's four registers in its four slots, so that the MMA kernels' operand order stays as it
is. Each program is run on random words and on every code in every slot, and checked bit for bit
against the format's encoding of the stored codes; the script prints its ops by kind.

    python bench/e2m1_orders.py              # ~20 seconds on one CPU core
"""
import argparse
import itertools

import torch

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


def twin_values(lows):
    """Values [(s, m)] -> the same with each one's pair 16 bits higher (mod 32) after it."""
    return [v for s, m in lows for v in ((s, m), ((s + 16) % 32, (m + 16) % 32))]


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


# ----------------------------------------------------------------------------------------------
# programs for one storage, checked bit for bit

# slot i of a half-word: (sign bit, lowest magnitude bit); the slot 16 higher holds its pair
STORAGE = [(12, 6), (13, 3), (14, 0), (15, 9)]
MAG_BF16, MAG_FP16, SIGNS = 0x01C001C0, 0x0E000E00, 0x80008000
# one op a tuple: (dest, op, a, b[, c]); operands are register names or constants
PROGRAMS = {
    FP16: [("r3", "and", "w", MAG_FP16 | SIGNS),                                     # in place
           ("t", "shl", "w", 3), ("r0", "and", "t", MAG_FP16 | SIGNS),               # both fields + 3
           ("x", "and", "w", 0x20382038), ("x", "mul", "x", 0x44), ("r1", "and", "x", MAG_FP16 | SIGNS),
           ("y", "and", "w", 0x40074007), ("y", "mul", "y", 0x202), ("r2", "and", "y", MAG_FP16 | SIGNS)],
    BF16: [("t", "shl", "w", 3),
           ("a", "and", "w", MAG_BF16), ("r0", "lop3", "t", SIGNS, "a"),           # (t & SIGNS) | a
           ("a", "and", "t", MAG_BF16), ("b", "shl", "w", 2), ("r1", "lop3", "b", SIGNS, "a"),
           ("x", "and", "w", 0x40074007), ("x", "mul", "x", 0x42), ("r2", "and", "x", MAG_BF16 | SIGNS),
           ("a", "mulhi", "w", 1 << 29), ("a", "and", "a", MAG_BF16), ("r3", "lop3", "w", SIGNS, "a")],
}
FMA_PIPE = {"shl", "mul", "mulhi"}                 # ops ptxas may issue as IMAD; and and lop3: ALU
MASK32 = (1 << 32) - 1


def run(program, w):
    """The program on words w (int64 tensor of 32-bit values) -> its registers r0..r3."""
    reg = {"w": w}
    val = lambda o: reg[o] if isinstance(o, str) else torch.full_like(w, o)
    for dest, op, *args in program:
        a, b = val(args[0]), val(args[1])
        if op == "and":
            out = a & b
        elif op == "shl":
            out = (a << b) & MASK32
        elif op == "mul":
            out = (a * b) & MASK32
        elif op == "mulhi":
            out = (a * b) >> 32
        elif op == "lop3":
            out = (a & b) | val(args[2])
        else:
            raise ValueError(f"unknown op {op}")
        reg[dest] = out
    return [reg[f"r{i}"] for i in range(4)]


def check(t, words):
    """Each register of PROGRAMS[t] against the format's bits of the codes in its slot and its pair's."""
    field = lambda w, b, n: (w >> b) & ((1 << n) - 1)
    for i, r in enumerate(run(PROGRAMS[t], words)):
        want, (s, m) = 0, STORAGE[i]
        for half in (0, 16):
            want = want | (field(words, s + half, 1) << (15 + half)) | (field(words, m + half, 3) << (t + half))
        if not torch.equal(r, want):
            return False
    return True


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
            values = twin_values([(s + 16 * (h & 1), m + 16 * (h >> 1)) for (s, m), h in zip(shapes, halves)])
            f = cost(values, FP16, twins)
            if f <= args.max_fp16:
                b = cost(values, BF16, twins)
                if f not in best or b < best[f][0]:
                    best[f] = (b, values)
    for f in sorted(best):
        b, values = best[f]
        print(f"fp16 {f} ops, bf16 {b} ops: (sign, lowest magnitude bit) of each value {values}")
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 1 << 32, (1 << 16,), generator=g, dtype=torch.int64)
    codes = torch.arange(16, dtype=torch.int64)
    for s, m in STORAGE:               # every code in every slot and its pair, the other bits random
        for half in (0, 16):
            clear = MASK32 ^ (((1 << s) | (7 << m)) << half)
            w = words[:16] & clear
            words = torch.cat([words, w | ((((codes >> 3) << s) | ((codes & 7) << m)) << half)])
    for t, name in ((FP16, "fp16"), (BF16, "bf16")):
        ops = [op for _, op, *_ in PROGRAMS[t]]
        fma = sum(op in FMA_PIPE for op in ops)
        print(f"STORAGE, {name}: {len(ops)} ops ({len(ops) - fma} ands and lop3s, {fma} shifts and multiplies), "
              f"{'exact' if check(t, words) else 'WRONG'} on {len(words)} words")


if __name__ == "__main__":
    main()
