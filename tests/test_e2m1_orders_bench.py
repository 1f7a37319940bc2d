"""bench/e2m1_orders.py's op count against decodes written out by hand, in the script's model: a distinct
non-zero rotation of the word is one op, and a register one op for each rotation it takes bits from."""
from test_step_bench import load_bench

# (sign, lowest magnitude bit) of one value of each pair; its pair lies 16 bits higher (mod 32)
CANDIDATE = [(0, 3), (1, 9), (18, 12), (15, 6)]
TWINS = [(0, 1), (2, 3), (4, 5), (6, 7)]


def _values(lows):
    return [v for s, m in lows for v in ((s, m), ((s + 16) % 32, (m + 16) % 32))]


def test_fp16_decode_of_the_candidate_counts_what_a_hand_decode_takes():
    # fp16 wants magnitudes at 9 / 25 and signs at 15 / 31. Pair (0, 3): magnitudes << 6 and signs << 15,
    # two rotations and two pieces (4). Pair (1, 9): magnitudes in place (an and), signs << 14 (3).
    # Pair (18, 12): one rotation right by 3 places all four fields (2). Pair (15, 6): magnitudes << 3,
    # signs in place (3). 12 ops: 5 rotations and 7 pieces.
    orders = load_bench("e2m1_orders")
    assert orders.cost(_values(CANDIDATE), orders.FP16, TWINS) == 12


def test_bf16_decode_shares_a_rotation_between_two_pairs():
    # bf16 wants magnitudes at 6 / 22. Pair (15, 6) is in place (1). The others take two rotations
    # each, but a rotation right by 3 serves both pair (1, 9)'s magnitudes and pair (18, 12)'s signs:
    # 5 rotations (<< 3, << 15; right 3, << 14; right 6) and 7 pieces, 12 ops, not 13.
    orders = load_bench("e2m1_orders")
    values = _values(CANDIDATE)
    assert orders.cost(values, orders.BF16, TWINS) == 12
    # with the rotation shared by no other pair, pair (1, 9) alone: 2 rotations and 2 pieces
    assert orders.cost(_values([(1, 9)]), orders.BF16, [(0, 1)]) == 4


def test_a_pair_in_place_costs_one_and():
    orders = load_bench("e2m1_orders")
    assert orders.cost(_values([(15, 6)]), orders.BF16, [(0, 1)]) == 1
    assert orders.cost(_values([(15, 9)]), orders.FP16, [(0, 1)]) == 1
