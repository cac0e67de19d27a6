"""specdec: the EAGLE-3 proposer agrees with speculators' training forward, its KV cache with a
recompute, speculative decoding is lossless, and acceptance is counted the way vLLM counts it.

Fixtures: a tiny target built by the target stage and an untrained draft built with speculators'
own config path (2 layers: one sliding-window with a short window, one full), random weights."""

import random

import pytest
import torch

from draftlab.serve.specdec import AcceptanceStats, Eagle3Proposer, GenerationResult, plain_greedy, speculative_generate
from tests.conftest import tiny_params

LAYER_IDS = [2, 4, 5]  # the tiny target's default aux layers (8 layers)
WINDOW = 6
MAX_NEW = 24


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The tiny target of the target stage, random weights (its pre-training costs minutes here)."""
    from draftlab.stages.target import build_model, build_tokenizer

    out = tmp_path_factory.mktemp("specdec") / "target"
    tokenizer = build_tokenizer()
    tiny = tiny_params(target={"tiny": {"hidden_size": 32, "intermediate_size": 64}}).target.tiny
    build_model(tiny, tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def target(target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="sdpa").eval()


def _build_draft(target_dir, norm_output: bool):
    """norm_output=True: speculators' defaults (Eagle 3.1: post-norm feedback, norm before residual);
    False: classic EAGLE-3 (pre-norm feedback, residual before the norm)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(0)
    layer_config = create_transformer_layer_config(
        str(target_dir), num_layers=2, draft_arch="llama", hidden_act=None,
        sliding_window=WINDOW, full_attention_indices=[1])  # fmt: skip
    vocab = layer_config.vocab_size
    kept = torch.tensor(sorted(random.Random(0).sample(range(vocab), 48)))  # a draft vocab ≠ target's
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    d2t = kept - torch.arange(len(kept))
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer_config, t2d=t2d, d2t=d2t, draft_vocab_size=len(kept), norm_before_residual=norm_output,
        norm_before_fc=True, norm_output=norm_output, ttt_steps=3, verifier_name_or_path=str(target_dir),
        target_layer_ids=LAYER_IDS, draft_attn_impl="sdpa")  # fmt: skip
    with torch.no_grad():  # trained norms are not all ones (with ones, RMSNorm∘RMSNorm hides a wrong feedback)
        for name, param in model.named_parameters():
            if "norm" in name and not name.startswith("verifier"):
                param.mul_(1 + 0.5 * torch.randn(param.shape))
    return model.eval()


@pytest.fixture(scope="module", params=[True, False], ids=["eagle3.1", "eagle3"])
def draft(request, target_dir):
    return _build_draft(target_dir, request.param)


@pytest.fixture(scope="module")
def references(target, target_dir):
    """(prompt, the target's own greedy output) for a few chat prompts."""
    from transformers import AutoTokenizer

    from draftlab import corpus

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok.apply_chat_template(c[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in corpus.conversations(3, seed=123)]
    return [(p, plain_greedy(target, p, MAX_NEW)) for p in prompts]


def _training_logits(draft, aux_T3H, ids_T, ttt_steps):
    """speculators' training forward (teacher-forced), lm_head output of every TTT step."""
    logits = []
    hook = draft.lm_head.register_forward_hook(lambda m, a, out: logits.append(out[0]))
    with torch.no_grad():
        draft(hidden_states=aux_T3H[None], input_ids=ids_T[None],
              document_ids=torch.zeros(1, len(ids_T), dtype=torch.long), ttt_steps=ttt_steps)
    hook.remove()
    return logits


def _random_inputs(draft, n, seed):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(n, 3 * draft.hidden_size, generator=g)
    return torch.randint(0, draft.verifier_vocab_size, (n,), generator=g), aux


def test_proposer_logits_equal_training_forward(draft):
    ids, aux = _random_inputs(draft, 16, seed=1)
    train = _training_logits(draft, aux, ids, ttt_steps=3)
    # step 0: every entry, with the causal + sliding-window mask of training
    got = Eagle3Proposer(draft).propose(ids.tolist(), aux, 1)
    torch.testing.assert_close(got.step0_logits_TV, train[0])
    # steps 1, 2: the chain from entry j, fed the same tokens training teacher-forces there
    for j in (2, WINDOW + 3, 13):
        prop = Eagle3Proposer(draft).propose(ids[: j + 1].tolist(), aux[: j + 1], 3, teacher_ids=ids[j + 1 : j + 3])
        for step in range(3):
            torch.testing.assert_close(prop.logits_KV[step], train[step][j])
    assert prop.token_ids[0] == int(train[0][j].argmax()) + int(draft.d2t[train[0][j].argmax()])


def test_cached_proposer_equals_recompute_over_rounds(draft):
    cached, fresh = Eagle3Proposer(draft), Eagle3Proposer(draft, use_cache=False)
    ids, aux = _random_inputs(draft, 7 + 2 + 1 + 4 + 3, seed=2)
    start = 0
    for chunk in (7, 2, 1, 4, 3):  # newly verified entries per round: accepted + bonus
        sl = slice(start, start + chunk)
        a, b = cached.propose(ids[sl].tolist(), aux[sl], 3), fresh.propose(ids[sl].tolist(), aux[sl], 3)
        torch.testing.assert_close(a.logits_KV, b.logits_KV)
        assert a.token_ids == b.token_ids
        start += chunk
    assert len(cached.slots) == start + 2  # verified entries + the last chain's 2 fed-back steps


class OracleProposer:
    """Proposes the target's own greedy continuation with one token spoiled per round (at a position
    cycling through 0..k, k = none), so every acceptance length 0..k occurs."""

    def __init__(self, prompt_len, reference):
        self.prompt_len, self.reference, self.rounds = prompt_len, reference, 0

    def reset(self):
        self.seen = 0

    def propose(self, next_ids, aux_T3H, k):
        self.seen += len(next_ids)
        done = self.seen - self.prompt_len + 1
        truth = (self.reference + [0] * k)[done : done + k]
        spoil, self.rounds = self.rounds % (k + 1), self.rounds + 1
        if spoil < k:
            truth[spoil] = (truth[spoil] + 1) % 50
        return type("P", (), {"token_ids": truth})()


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_is_the_targets_greedy_output(target, target_dir, references, k):
    draft = _build_draft(target_dir, norm_output=True)
    stats = AcceptanceStats(k)
    for prompt, plain in references:
        for proposer in (draft, OracleProposer(len(prompt), plain.tokens)):
            spec = speculative_generate(target, proposer, prompt, num_speculative_tokens=k,
                                        max_new_tokens=MAX_NEW, layer_ids=LAYER_IDS)
            assert spec.tokens == plain.tokens
        stats.add(spec, plain)
    assert stats.accepted > 0 and stats.lossless_mismatches == 0


def test_draft_sees_the_targets_states_of_the_verified_prefix(target, target_dir, references):
    """Every round's proposal equals a from-scratch one over the whole verified sequence, fed the
    target's aux states from one plain forward: the pairing g_j ↔ x_{j+1} survives rejections."""
    from draftlab.models import LayerCapture

    draft = _build_draft(target_dir, norm_output=True)
    prompt, plain = references[1]
    rounds = []

    class Recording(Eagle3Proposer):
        def propose(self, next_ids, aux_T3H, k):
            out = super().propose(next_ids, aux_T3H, k)
            rounds.append((len(self.next_ids), out.token_ids))
            return out

    spec = speculative_generate(target, Recording(draft), prompt, num_speculative_tokens=3,
                                max_new_tokens=MAX_NEW, layer_ids=LAYER_IDS)
    seq = prompt + spec.tokens
    capture = LayerCapture(target, LAYER_IDS)
    with torch.no_grad():
        target(input_ids=torch.tensor([seq]))
    capture.close()
    aux_T3H = capture.stacked()[0, :, :3].flatten(1)  # the store's layout: 3 aux layers, concatenated
    for n, drafted in rounds:
        expected = Eagle3Proposer(draft, use_cache=False).propose(seq[1 : n + 1], aux_T3H[:n], 3)
        assert drafted == expected.token_ids
    assert len(rounds) == spec.drafts > 5


def test_stop_token_ends_both_the_same_way(target, references):
    prompt, plain = references[0]
    stop = plain.tokens[5]
    first = plain.tokens.index(stop)
    short = plain_greedy(target, prompt, MAX_NEW, stop_ids={stop})
    assert short.tokens == plain.tokens[: first + 1]
    spec = speculative_generate(target, OracleProposer(len(prompt), plain.tokens), prompt,
                                num_speculative_tokens=3, max_new_tokens=MAX_NEW, layer_ids=LAYER_IDS,
                                stop_ids={stop})
    assert spec.tokens == short.tokens


def test_speculation_saves_target_forwards_when_drafts_are_accepted(target, references):
    k = 3
    for prompt, plain in references:
        assert plain.target_forwards == len(plain.tokens) == MAX_NEW
        spec = speculative_generate(target, OracleProposer(len(prompt), plain.tokens), prompt,
                                    num_speculative_tokens=k, max_new_tokens=MAX_NEW, layer_ids=LAYER_IDS)
        assert spec.target_forwards == 1 + spec.drafts  # prefill, then one verification per round
        # each round emits its accepted drafts + 1; only the last can be cut by the budget
        assert len(spec.tokens) <= 1 + spec.drafts + spec.accepted < len(spec.tokens) + k
        assert spec.accepted > k and spec.target_forwards < plain.target_forwards


def test_acceptance_stats_follow_vllm_convention():
    stats = AcceptanceStats(3)
    assert stats.mean_acceptance_length == 1.0 and stats.acceptance_per_position == [0.0, 0.0, 0.0]
    a = GenerationResult(tokens=list(range(11)), target_forwards=5, drafts=4, accepted_per_pos=[3, 2, 1])
    b = GenerationResult(tokens=[1, 2, 3, 4], target_forwards=3, drafts=2, accepted_per_pos=[1, 0, 0])
    stats.add(a)  # plain forwards for the same tokens: one per token
    stats.add(b, GenerationResult(tokens=[1, 2, 3, 5], target_forwards=4))
    assert (stats.drafts, stats.accepted, stats.emitted_tokens) == (6, 7, 15)
    assert stats.mean_acceptance_length == pytest.approx(1 + 7 / 6)
    assert stats.acceptance_per_position == pytest.approx([4 / 6, 2 / 6, 1 / 6])
    assert (stats.target_forwards, stats.plain_forwards, stats.forward_passes_saved) == (8, 15, 7)
    assert stats.lossless_mismatches == 1
    assert stats.to_json()["mean_acceptance_length"] == round(1 + 7 / 6, 4)
