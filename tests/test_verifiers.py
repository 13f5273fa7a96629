"""Verifiers: exact greedy cases, and goodness-of-fit proofs that sampling verification is lossless.

The statistical tests use a toy two-token "language model" on a tiny vocabulary: the target emits
y1 ~ p0 and then y2 ~ p1[y1]; the drafter proposes from q0 and q1[.]. Each trial drafts, verifies once,
and records the first two emitted tokens (if the step emitted only one, the second is drawn from the
exact target conditional p1[y1], which is what any later lossless step would do). A chi-square
goodness-of-fit test then compares the joint counts of (y1, y2), and of y1 alone, with the exact target
p0[y1] * p1[y1, y2]. Deliberately lossy variants run through the same test and must fail it: that proves
the test has the power to catch a broken verifier.
"""
import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specdec.verifiers import (
    VerifyResult,
    greedy_chain,
    greedy_tree,
    sample_chain,
    sample_tree,
    typical_tree,
)

PASS = 1e-3  # a correct verifier must give p-value > PASS
FAIL = 1e-6  # a lossy one must give p-value < FAIL
N_CHAIN = 12_000
N_TREE = 8_000
N_CONTROL = 4_000  # the lossy controls fail by a wide margin (p ~ 1e-15 or smaller) already here


# ----------------------------------------------------------------------------- greedy, exact cases


def onehot_scores(argmaxes, V=6):
    """[len, V] scores whose argmax rows are `argmaxes` (with a runner-up to make it non-trivial)."""
    scores = torch.zeros(len(argmaxes), V)
    for i, a in enumerate(argmaxes):
        scores[i, a] = 2.0
        scores[i, (a + 1) % V] = 1.5
    return scores


def test_greedy_chain_all_accepted_emits_bonus():
    res = greedy_chain(torch.tensor([3, 1, 4]), onehot_scores([3, 1, 4, 5]))
    assert res.path == [0, 1, 2] and res.next_token == 5
    assert res.beta == [1.0, 1.0, 1.0]


def test_greedy_chain_first_mismatch_emits_correction():
    res = greedy_chain(torch.tensor([3, 1, 4]), onehot_scores([3, 2, 4, 5]))
    assert res.path == [0] and res.next_token == 2
    assert res.beta == [1.0, 0.0, 1.0]  # position 2 would match, but is never reached
    res = greedy_chain(torch.tensor([0, 1]), onehot_scores([5, 1, 2]))
    assert res.path == [] and res.next_token == 5


def test_greedy_chain_empty_draft_and_ties():
    res = greedy_chain(torch.zeros(0, dtype=torch.long), onehot_scores([4]))
    assert res == VerifyResult([], 4, res.beta) and res.beta == []
    tied = torch.tensor([[0.0, 2.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # torch.argmax -> lowest index
    assert greedy_chain(torch.tensor([2]), tied) == VerifyResult([], 1, [0.0])
    res = greedy_chain(torch.tensor([1]), tied)
    assert res.path == [0] and res.next_token == 0


def test_greedy_chain_bad_shapes():
    with pytest.raises(ValueError, match="target_scores"):
        greedy_chain(torch.tensor([1, 2]), torch.zeros(2, 5))


def test_greedy_tree_follows_argmax_child():
    #        root
    #       /  |  \
    #      0   1   2          tokens 5 3 1
    #     / \      |
    #    3   4     5          tokens 2 0 | 2
    #    |
    #    6                    token 4
    tokens = torch.tensor([5, 3, 1, 2, 0, 2, 4])
    parents = torch.tensor([-1, -1, -1, 0, 0, 2, 3])
    # root -> 3 (node 1), a leaf: the bonus is the argmax of node 1's row (row 2)
    scores = onehot_scores([3, 0, 4, 1, 1, 1, 1, 1])
    res = greedy_tree(tokens, parents, scores)
    assert res.path == [1] and res.next_token == 4 and res.beta == [1.0]
    # root -> 5 (node 0) -> 2 (node 3) -> 4 (node 6) -> bonus from node 6's row
    scores = onehot_scores([5, 2, 0, 0, 4, 0, 0, 3])
    res = greedy_tree(tokens, parents, scores)
    assert res.path == [0, 3, 6] and res.next_token == 3 and res.beta == [1.0, 1.0, 1.0]
    # root -> 1 (node 2) -> argmax 4 != 2 (node 5): correction 4
    scores = onehot_scores([1, 0, 0, 4, 0, 0, 0, 0])
    res = greedy_tree(tokens, parents, scores)
    assert res.path == [2] and res.next_token == 4 and res.beta == [1.0, 0.0]
    # no child of the root matches
    res = greedy_tree(tokens, parents, onehot_scores([0] * 8))
    assert res.path == [] and res.next_token == 0 and res.beta == [0.0]


def test_greedy_tree_ties_duplicates_and_empty():
    # root argmax tie between 2 and 4 -> 2 (torch.argmax); two siblings carry 2 -> the first one (node 1)
    tokens = torch.tensor([4, 2, 2])
    parents = torch.tensor([-1, -1, -1])
    scores = torch.tensor([[0.0, 0.0, 3.0, 0.0, 3.0], [0.0] * 5, [0, 0, 0, 0, 1.0], [1.0, 0, 0, 0, 0]])
    res = greedy_tree(tokens, parents, scores)
    assert res.path == [1] and res.next_token == 4
    empty = torch.zeros(0, dtype=torch.long)
    assert greedy_tree(empty, empty, scores[:1]).path == [] and greedy_tree(empty, empty, scores[:1]).next_token == 2
    # a chain written as a tree agrees with greedy_chain
    chain_scores = onehot_scores([3, 1, 0, 5])
    a = greedy_tree(torch.tensor([3, 1, 4]), torch.tensor([-1, 0, 1]), chain_scores)
    b = greedy_chain(torch.tensor([3, 1, 4]), chain_scores)
    assert (a.path, a.next_token) == (b.path, b.next_token) == ([0, 1], 0)


def test_tree_rejects_bad_parents_and_shapes():
    with pytest.raises(ValueError, match="parents"):
        greedy_tree(torch.tensor([1, 2]), torch.tensor([-1, 1]), torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"\[n\+1, V\]"):
        sample_tree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.zeros(2, 4), None, None, True)
    with pytest.raises(ValueError, match="q must be"):
        sample_chain(torch.tensor([1, 2]), torch.full((3, 4), 0.25), torch.full((3, 4), 0.25))


# ----------------------------------------------------------------------------- toy model + statistics


def toy_model(V: int, seed: int, kind: str = "random"):
    """p0 [V], p1 [V, V], q0 [V], q1 [V, V] as float32 rows that each sum to 1.

    kind: "random"  Dirichlet(1) rows
          "zeros"   p and q each have zeros where the other is positive (and one q1 row is disjoint from p1)
          "equal"   q == p
    """
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V), size=V + 1)
    q = rng.dirichlet(np.ones(V), size=V + 1)
    if kind == "zeros":
        for r in range(V + 1):
            zp, zq = rng.choice(V, size=2, replace=False)
            p[r, zp] = 0.0
            q[r, zq] = 0.0
        q[2] = 0.0  # p1[1] and q1[1] (rows 2) with disjoint supports
        q[2, : V // 2] = rng.dirichlet(np.ones(V // 2))
        p[2, : V // 2] = 0.0
        p[2, V // 2 :] = rng.dirichlet(np.ones(V - V // 2))
    if kind == "equal":
        q = p.copy()
    p = torch.tensor(p / p.sum(-1, keepdims=True), dtype=torch.float32)
    q = torch.tensor(q / q.sum(-1, keepdims=True), dtype=torch.float32)
    return p[0], p[1:], q[0], q[1:]


def as_f64(probs: torch.Tensor) -> np.ndarray:
    out = probs.double().numpy()
    return out / out.sum(-1, keepdims=True)


def draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: probs [..., V] (rows broadcast against u [...]) -> token ids [...]."""
    cdf = np.cumsum(probs, axis=-1)
    return np.minimum((u[..., None] >= cdf).sum(-1), probs.shape[-1] - 1)


def draw_without_replacement(probs: np.ndarray, m: int, rng) -> np.ndarray:
    """[N, V] rows -> [N, m]: sequential draws without replacement (Gumbel top-k)."""
    with np.errstate(divide="ignore"):
        keys = np.log(probs) + rng.gumbel(size=probs.shape)
    return np.argsort(-keys, axis=-1, kind="stable")[:, :m]


def gof_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; zero-probability cells must be empty, cells with expected < 5 merged."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel()
    impossible = probs == 0
    assert counts[impossible].sum() == 0, "a zero-probability token was emitted"
    counts, expected = counts[~impossible], probs[~impossible] * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(chisquare(counts, expected * counts.sum() / expected.sum()).pvalue)


class Toy:
    """The toy model with float64 views for the exact target and float32 tensors for the verifiers."""

    def __init__(self, V, seed, kind="random"):
        self.V = V
        self.p0, self.p1, self.q0, self.q1 = toy_model(V, seed, kind)
        self.uniform = torch.full((V,), 1.0 / V)  # the third token's distribution (never recorded)
        self.target = as_f64(self.p0)[:, None] * as_f64(self.p1)  # [V, V] exact joint of (y1, y2)

    def record(self, emitted_rows, trials_rng):
        """emitted_rows: list of emitted-token lists -> [V, V] counts of (y1, y2)."""
        N = len(emitted_rows)
        u = trials_rng.random(N)
        p1 = as_f64(self.p1)
        counts = np.zeros((self.V, self.V), dtype=np.int64)
        for i, out in enumerate(emitted_rows):
            y1 = out[0]
            y2 = out[1] if len(out) > 1 else int(draw(p1[y1], u[i]))
            counts[y1, y2] += 1
        return counts

    def pvalues(self, counts):
        return gof_pvalue(counts.sum(1), self.target.sum(1)), gof_pvalue(counts, self.target)


# ----------------------------------------------------------------------------- chain sampling


def run_chain(toy: Toy, N: int, seed: int, drafter: str, give_q: bool):
    """k=2 chain per trial. drafter: "sample" (x ~ q) or "argmax" (deterministic, q one-hot).

    Returns (joint counts, accepted-at-1 count, {x1: [tried-2, accepted-2]}, first result's beta per x1).
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    q0, q1 = as_f64(toy.q0), as_f64(toy.q1)
    if drafter == "sample":
        x1 = draw(q0, rng.random(N))
        x2 = draw(q1[x1], rng.random(N))
    else:
        x1 = np.full(N, int(np.argmax(q0)))
        x2 = np.argmax(q1[x1], axis=-1)
    P = {a: torch.stack([toy.p0, toy.p1[a], toy.uniform]) for a in range(toy.V)}
    Q = {a: torch.stack([toy.q0, toy.q1[a]]) for a in range(toy.V)}
    X = {(a, b): torch.tensor([a, b]) for a in range(toy.V) for b in range(toy.V)}
    emitted, accepted1, second = [], 0, {a: [0, 0] for a in range(toy.V)}
    betas = {}
    for a, b in zip(x1.tolist(), x2.tolist()):
        res = sample_chain(X[a, b], P[a], Q[a] if give_q else None, gen)
        betas.setdefault(a, res.beta)
        emitted.append([a, b][: len(res.path)] + [res.next_token])
        if res.path:
            accepted1 += 1
            second[a][0] += 1
            second[a][1] += len(res.path) == 2
    return toy.record(emitted, rng), accepted1, second, betas


def sum_min(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(np.minimum(as_f64(p), as_f64(q)).sum())


def assert_rate(successes: int, trials: int, prob: float):
    """Binomial count within 5 standard deviations (+1 for the discreteness) of trials * prob."""
    sd = np.sqrt(trials * prob * (1 - prob))
    assert abs(successes - trials * prob) <= 5 * sd + 1, (successes, trials, prob)


@pytest.mark.parametrize(
    "V, seed, kind, drafter, give_q",
    [
        (5, 1, "random", "sample", True),  # stochastic drafter, softmax q
        (4, 2, "zeros", "sample", True),  # q = 0 where p > 0, p = 0 where q > 0, disjoint supports
        (5, 3, "random", "argmax", False),  # deterministic drafter, one-hot q
        (5, 4, "random", "sample", False),  # one-hot rule is lossless for ANY proposal (just slower)
    ],
)
def test_sample_chain_preserves_target_distribution(V, seed, kind, drafter, give_q):
    toy = Toy(V, seed, kind)
    counts, accepted1, second, betas = run_chain(toy, N_CHAIN, seed, drafter, give_q)
    p_first, p_joint = toy.pvalues(counts)
    assert p_first > PASS and p_joint > PASS, (p_first, p_joint)

    # beta is the exact acceptance probability: formula, and empirical frequency at both positions
    for a, beta in betas.items():
        if give_q:
            expected = [sum_min(toy.p0, toy.q0), sum_min(toy.p1[a], toy.q1[a])]
        else:
            b = int(np.argmax(as_f64(toy.q1)[a])) if drafter == "argmax" else None
            expected = [float(toy.p0[a])] + ([float(toy.p1[a, b])] if b is not None else [])
        torch.testing.assert_close(torch.tensor(beta[: len(expected)], dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64))
    if give_q:
        assert_rate(accepted1, N_CHAIN, sum_min(toy.p0, toy.q0))
        for a, (tried, ok) in second.items():
            assert_rate(ok, tried, sum_min(toy.p1[a], toy.q1[a]))


def test_sample_chain_lossy_control_fails():
    """A deterministic (argmax) drafter verified with its softmax q instead of one-hot: NOT lossless."""
    toy = Toy(5, 3)
    counts, *_ = run_chain(toy, N_CONTROL, 3, "argmax", give_q=True)
    p_first, p_joint = toy.pvalues(counts)
    assert p_first < FAIL and p_joint < FAIL, (p_first, p_joint)


def test_sample_chain_equal_distributions_accept_everything():
    toy = Toy(5, 5, "equal")
    gen = torch.Generator().manual_seed(0)
    p = torch.stack([toy.p0, toy.p1[1], toy.uniform])
    for _ in range(200):
        res = sample_chain(torch.tensor([1, 2]), p, p[:2].clone(), gen)
        assert res.path == [0, 1] and 0 <= res.next_token < 5
        assert torch.isfinite(torch.tensor(res.beta)).all()
    assert res.beta == [1.0, 1.0]


def test_sample_chain_seeded_and_k0():
    toy = Toy(5, 6)
    p = torch.stack([toy.p0, toy.p1[2], toy.uniform])
    q = torch.stack([toy.q0, toy.q1[2]])
    runs = [
        [sample_chain(torch.tensor([2, 0]), p, q, g) for _ in range(30)]
        for g in (torch.Generator().manual_seed(11), torch.Generator().manual_seed(11))
    ]
    assert [(r.path, r.next_token) for r in runs[0]] == [(r.path, r.next_token) for r in runs[1]]
    res = sample_chain(torch.zeros(0, dtype=torch.long), toy.p0[None], None, torch.Generator().manual_seed(0))
    assert res.path == [] and res.beta == [] and toy.p0[res.next_token] > 0


# ----------------------------------------------------------------------------- tree sampling

#        root
#      /  |  \
#     0   1   2         3 children of the root, drawn from q0
#    / \  |             node 0: 2 children from q1[t0]; node 1: 1 child from q1[t1]; node 2: a leaf
#   3   4 5
PARENTS = torch.tensor([-1, -1, -1, 0, 0, 1])


def tree_drafts(toy: Toy, N: int, rng, mode: str) -> np.ndarray:
    """[N, 6] draft tokens. mode: "iid" (with replacement), "norepl" (without), "topk" (deterministic)."""
    q0, q1 = as_f64(toy.q0), as_f64(toy.q1)
    if mode == "iid":
        root = draw(q0, rng.random((N, 3)))
        kids0 = draw(q1[root[:, 0]][:, None, :], rng.random((N, 2)))
        kids1 = draw(q1[root[:, 1]], rng.random(N))[:, None]
    elif mode == "norepl":
        root = draw_without_replacement(np.broadcast_to(q0, (N, toy.V)), 3, rng)
        kids0 = draw_without_replacement(q1[root[:, 0]], 2, rng)
        kids1 = draw_without_replacement(q1[root[:, 1]], 1, rng)
    else:
        top = np.argsort(-q1, axis=-1, kind="stable")
        root = np.broadcast_to(np.argsort(-q0, kind="stable")[:3], (N, 3))
        kids0 = top[root[:, 0], :2]
        kids1 = top[root[:, 1], :1]
    return np.concatenate([root, kids0, kids1], axis=1)


def run_tree(toy: Toy, N: int, seed: int, mode: str, verify):
    """verify(tokens [6], parents [6], p [7, V], q [6, V], generator) -> VerifyResult.

    Returns (joint counts, number of trials with a root child accepted, sum of beta[0]).
    """
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    drafts = tree_drafts(toy, N, rng, mode)
    P, Q = {}, {}
    emitted, accepted, beta0 = [], 0, 0.0
    for row in drafts.tolist():
        t0, t1, t2 = row[:3]
        if (t0, t1, t2) not in P:
            P[t0, t1, t2] = torch.stack([toy.p0, toy.p1[t0], toy.p1[t1], toy.p1[t2]] + [toy.uniform] * 3)
            Q[t0, t1, t2] = torch.stack([toy.q0] * 3 + [toy.q1[t0]] * 2 + [toy.q1[t1]])
        res = verify(torch.tensor(row), PARENTS, P[t0, t1, t2], Q[t0, t1, t2], gen)
        emitted.append([row[i] for i in res.path] + [res.next_token])
        accepted += bool(res.path)
        beta0 += float(res.beta[0]) if res.beta is not None else 0.0
    return toy.record(emitted, rng), accepted, beta0


@pytest.mark.parametrize(
    "mode, with_replacement, give_q",
    [
        ("iid", True, True),  # SpecInfer: siblings i.i.d. from q
        ("norepl", False, True),  # RSD / Sequoia: siblings without replacement
        ("topk", True, False),  # deterministic top-k tree (EAGLE-2 / SGLang): one-hot q
    ],
)
def test_sample_tree_preserves_target_distribution(mode, with_replacement, give_q):
    toy = Toy(5, 10)

    def verify(tokens, parents, p, q, gen):
        return sample_tree(tokens, parents, p, q if give_q else None, gen, with_replacement)

    counts, accepted, beta0 = run_tree(toy, N_TREE, 20, mode, verify)
    p_first, p_joint = toy.pvalues(counts)
    assert p_first > PASS and p_joint > PASS, (p_first, p_joint)
    # beta[0] = P(some root child accepted | drafted children): its mean matches the accept frequency
    assert abs(accepted - beta0) <= 5 * np.sqrt(N_TREE * 0.25) + 1, (accepted, beta0)


def test_sample_tree_handles_zeros_and_disjoint_supports():
    toy = Toy(5, 11, "zeros")

    def verify(tokens, parents, p, q, gen):
        return sample_tree(tokens, parents, p, q, gen, False)

    counts, _, _ = run_tree(toy, N_TREE // 2, 21, "norepl", verify)
    p_first, p_joint = toy.pvalues(counts)
    assert p_first > PASS and p_joint > PASS, (p_first, p_joint)


@pytest.mark.parametrize(
    "control, mode",
    [
        ("topk_judged_with_softmax_q", "topk"),  # deterministic children judged as if drawn from q
        ("iid_judged_without_replacement", "iid"),  # the wrong with_replacement flag, both ways
        ("without_replacement_judged_iid", "norepl"),
        ("typical", "iid"),  # Medusa typical acceptance: lossy by design
    ],
)
def test_sample_tree_lossy_controls_fail(control, mode):
    toy = Toy(5, 10)

    def verify(tokens, parents, p, q, gen):
        if control == "typical":
            return typical_tree(tokens, parents, p, gen)
        return sample_tree(tokens, parents, p, q, gen, with_replacement=(mode == "norepl"))

    counts, _, _ = run_tree(toy, N_CONTROL, 20, mode, verify)
    p_first, p_joint = toy.pvalues(counts)
    assert p_first < FAIL and p_joint < FAIL, (p_first, p_joint)


def test_sample_tree_chain_shaped_equals_chain_rule():
    """A chain written as a tree: same accepted paths and tokens as sample_chain under the same seed
    (both draw k uniforms, then V exponentials)."""
    toy = Toy(5, 12)
    p = torch.stack([toy.p0, toy.p1[3], toy.uniform])
    q = torch.stack([toy.q0, toy.q1[3]])
    tokens, parents = torch.tensor([3, 1]), torch.tensor([-1, 0])
    for seed in range(50):
        a = sample_chain(tokens, p, q, torch.Generator().manual_seed(seed))
        b = sample_tree(tokens, parents, p, q, torch.Generator().manual_seed(seed), True)
        assert (a.path, a.next_token) == (b.path, b.next_token)
        tried = len(b.beta)  # single child per depth: beta = min(1, p(x) / q(x)) at each tried depth
        ratio = p[:tried].gather(1, tokens[:tried, None])[:, 0] / q[:tried].gather(1, tokens[:tried, None])[:, 0]
        torch.testing.assert_close(torch.tensor(b.beta, dtype=torch.float64), ratio.clamp(max=1).double())
        a = sample_chain(tokens, p, None, torch.Generator().manual_seed(seed))
        b = sample_tree(tokens, parents, p, None, torch.Generator().manual_seed(seed), False)
        assert (a.path, a.next_token) == (b.path, b.next_token)


def test_sample_tree_empty_and_leaf_bonus():
    toy = Toy(4, 13)
    empty = torch.zeros(0, dtype=torch.long)
    res = sample_tree(empty, empty, toy.p0[None], None, torch.Generator().manual_seed(0), True)
    assert res.path == [] and res.beta == []
    # q == p at the root: the first child is always accepted, then its leaf row gives the bonus
    p = torch.stack([toy.p0, torch.tensor([0.0, 0.0, 1.0, 0.0])])
    res = sample_tree(torch.tensor([1]), torch.tensor([-1]), p, toy.p0[None], torch.Generator().manual_seed(0), True)
    assert res.path == [0] and res.next_token == 2 and res.beta == [1.0]


# ----------------------------------------------------------------------------- typical (lossy)


def test_typical_tree_rule():
    # root p is peaked: the entropy term exceeds 0.09, so the cutoff is posterior_threshold = 0.09
    p_root = torch.tensor([0.05, 0.9, 0.03, 0.02])
    H = float(-(p_root * p_root.log()).sum())
    assert 0.3 * np.exp(-H) > 0.09
    tokens = torch.tensor([0, 1, 3])  # p = 0.05 (not typical), 0.9 (typical); node 2 is node 1's child
    parents = torch.tensor([-1, -1, 1])
    p = torch.stack([p_root, torch.full((4,), 0.25), torch.eye(4)[3], torch.eye(4)[1]])  # rows: root, nodes 0-2
    res = typical_tree(tokens, parents, p, torch.Generator().manual_seed(0))
    assert res.path == [1, 2] and res.next_token == 1 and res.beta is None


def test_typical_tree_cutoff_matches_formula():
    """Depth-1 trees on random (some flat, some peaked) distributions: accepted iff
    p(x) > min(threshold, alpha * exp(-H(p)))."""
    rng = np.random.default_rng(0)
    gen = torch.Generator().manual_seed(0)
    for i in range(200):
        V = 8
        probs = rng.dirichlet(np.full(V, 0.2 if i % 2 else 5.0))
        x = int(rng.integers(V))
        H = -(probs[probs > 0] * np.log(probs[probs > 0])).sum()
        cutoff = min(0.09, 0.3 * np.exp(-H))
        if abs(probs[x] - cutoff) < 1e-5:
            continue
        p = torch.tensor(np.stack([probs, np.full(V, 1 / V)]), dtype=torch.float32)
        res = typical_tree(torch.tensor([x]), torch.tensor([-1]), p, gen)
        assert (res.path == [0]) == (probs[x] > cutoff), (probs, x, cutoff)
