"""bench/e2m1_orders.py: its op count against decodes written out by hand, in the script's model (a
distinct non-zero rotation of the word is one op, and a register one op for each rotation it takes bits
from); its decode programs against the format's bits of the codes they read, and a wrong one caught."""
import torch

from test_step_bench import load_bench

# (sign, lowest magnitude bit) of one value of each pair; its pair lies 16 bits higher (mod 32)
CANDIDATE = [(0, 3), (1, 9), (18, 12), (15, 6)]
TWINS = [(0, 1), (2, 3), (4, 5), (6, 7)]


def _words():
    return torch.randint(0, 1 << 32, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)


def test_fp16_decode_of_the_candidate_counts_what_a_hand_decode_takes():
    # fp16 wants magnitudes at 9 / 25 and signs at 15 / 31. Pair (0, 3): magnitudes << 6 and signs << 15,
    # two rotations and two pieces (4). Pair (1, 9): magnitudes in place (an and), signs << 14 (3).
    # Pair (18, 12): one rotation right by 3 places all four fields (2). Pair (15, 6): magnitudes << 3,
    # signs in place (3). 12 ops: 5 rotations and 7 pieces.
    orders = load_bench("e2m1_orders")
    assert orders.cost(orders.twin_values(CANDIDATE), orders.FP16, TWINS) == 12


def test_bf16_decode_shares_a_rotation_between_two_pairs():
    # bf16 wants magnitudes at 6 / 22. Pair (15, 6) is in place (1). The others take two rotations
    # each, but a rotation right by 3 serves both pair (1, 9)'s magnitudes and pair (18, 12)'s signs:
    # 5 rotations (<< 3, << 15; right 3, << 14; right 6) and 7 pieces, 12 ops, not 13.
    orders = load_bench("e2m1_orders")
    assert orders.cost(orders.twin_values(CANDIDATE), orders.BF16, TWINS) == 12
    # pair (1, 9) alone, its rotation shared with no other pair: 2 rotations and 2 pieces
    assert orders.cost(orders.twin_values([(1, 9)]), orders.BF16, [(0, 1)]) == 4


def test_a_pair_in_place_costs_one_and():
    orders = load_bench("e2m1_orders")
    assert orders.cost(orders.twin_values([(15, 6)]), orders.BF16, [(0, 1)]) == 1
    assert orders.cost(orders.twin_values([(15, 9)]), orders.FP16, [(0, 1)]) == 1


def test_the_programs_decode_their_storage_and_a_wrong_one_is_caught(monkeypatch):
    orders = load_bench("e2m1_orders")
    words = _words()
    assert orders.check(orders.FP16, words) and orders.check(orders.BF16, words)
    # one register by hand: slot 0 (sign 12, magnitude 6..8) to fp16 is (w << 3) & 0x8E008E00
    w = (1 << 12) | (0b101 << 6) | (0b011 << 22)             # sign 1, magnitude 5; its pair: sign 0, magnitude 3
    r0 = orders.run(orders.PROGRAMS[orders.FP16], torch.tensor([w]))[0].item()
    assert r0 == (1 << 15) | (0b101 << 9) | (0b011 << 25)
    # a multiplier one shift too far: slot 1's magnitude lands a bit too high
    wrong = [("x", "mul", "x", 0x84) if op[:2] == ("x", "mul") else op for op in orders.PROGRAMS[orders.FP16]]
    monkeypatch.setitem(orders.PROGRAMS, orders.FP16, wrong)
    assert not orders.check(orders.FP16, words)


def test_mul_hi_by_a_power_of_two_is_a_right_shift():
    orders = load_bench("e2m1_orders")
    words = _words()
    program = [("r0", "mulhi", "w", 1 << 29)] + [(f"r{i}", "and", "w", 0) for i in (1, 2, 3)]
    assert torch.equal(orders.run(program, words)[0], words >> 3)
