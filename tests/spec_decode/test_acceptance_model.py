"""The acceptance model calibrates draft confidences against what the target accepted."""
import numpy as np

from specserve.step_types import DraftOutcome
from specserve.spec_decode.acceptance_model import AcceptanceModel, pav


def stream(model, rng, n, true_acceptance, draft="d", request=lambda i: f"r{i % 50}", k=4):
    """n drafts of k tokens; each token accepted with true_acceptance(confidence, position)."""
    for i in range(n):
        conf = rng.uniform(0.05, 1.0, k)
        accepted = 0
        while accepted < k and rng.random() < true_acceptance(conf[accepted], accepted):
            accepted += 1
        model.observe(DraftOutcome(request(i), draft, k, accepted, conf.tolist()))


def test_calibration_converges_to_the_true_acceptance_curve():
    rng = np.random.default_rng(0)
    model = AcceptanceModel(4)
    overconfident = lambda c, m: c ** 2  # noqa: E731  a draft that is sure more often than right
    stream(model, rng, 300, overconfident)
    early = model.calibration_error
    stream(model, rng, 6000, overconfident)
    centers = (np.arange(10) + 0.5) / 10
    curve = model.calibration("d", 0)(centers)
    assert np.max(np.abs(curve - centers ** 2)) < 0.06
    assert np.all(np.diff(curve) >= 0)  # monotone in confidence
    model.recent.clear()
    stream(model, rng, 2000, overconfident)
    assert model.calibration_error < 0.03 < early


def test_positions_drafts_and_requests_have_their_own_statistics():
    rng = np.random.default_rng(1)
    model = AcceptanceModel(4)
    stream(model, rng, 3000, lambda c, m: 0.9 - 0.2 * m, draft="ngram", request=lambda i: "lookup")
    stream(model, rng, 3000, lambda c, m: 0.3, draft="chat", request=lambda i: f"c{i % 20}")
    lookup, chat = model.position_acceptance("ngram"), model.position_acceptance("chat")
    assert np.allclose(lookup, [0.9, 0.7, 0.5, 0.3], atol=0.05)
    assert np.allclose(chat[:3], 0.3, atol=0.05)  # position 4 is reached 3000 · 0.3³ ≈ 80 times: noisier
    # a request that is accepted more than its draft's average is predicted higher
    model.observe(DraftOutcome("lucky", "chat", 4, 4, None))
    model.observe(DraftOutcome("lucky", "chat", 4, 4, None))
    assert model.predict("lucky", "chat")[0] > model.predict("new", "chat")[0]
    model.forget("lucky")
    assert model.request_factor("lucky", "chat") == 1.0
    # a request not served by any proposer yet: every draft's counts pooled per position, not one flat rate
    unassigned = model.position_acceptance(None)
    assert lookup[0] > unassigned[0] > chat[0] and unassigned[-1] < unassigned[0] - 0.1


def test_an_unseen_draft_trusts_its_confidences():
    model = AcceptanceModel(3)
    assert np.allclose(model.predict("x", "new", [0.95, 0.15]), [0.95, 0.15, 0.6], atol=0.01)


def test_pool_adjacent_violators():
    assert np.allclose(pav(np.array([0.1, 0.5, 0.3, 0.9]), np.ones(4)), [0.1, 0.4, 0.4, 0.9])
    assert np.allclose(pav(np.array([0.3, 0.1]), np.array([3.0, 1.0])), [0.25, 0.25])


def test_a_batch_prediction_is_each_requests_prediction():
    m = AcceptanceModel(4)
    rng = np.random.default_rng(0)
    for i in range(300):
        draft = ["code", "chat", "ngram"][i % 3]
        m.observe(DraftOutcome(f"r{i % 7}", draft, 4, int(rng.integers(0, 5)), None))
    asked = [(f"r{i}", d) for i in range(9) for d in ("code", "chat", "ngram", None, "unseen")]
    want = np.array([m.predict(rid, d) for rid, d in asked])
    np.testing.assert_allclose(m.predict_batch(asked), want)
