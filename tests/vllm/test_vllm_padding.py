"""vLLM never returns a padding row of the head: a `qwen3-tiny` checkpoint (264 rows, the byte tokenizer's 259
ids) whose padding rows take nearly all the mass, served through `inference --backend vllm` (the adapter adds
`arbor.inference.vllm.logits`'s mask), samples and decodes greedily only tokenizer ids, and the logprobs it
reports are those of the tempered distribution renormalised over the real ids.

The check runs on the second server of test_vllm_backend's router test (`serve_padding_heavy_model`, then
`check_never_samples_a_padding_row` before that server is killed): one vLLM start (~50 s of a 2-core CI machine)
serves both tests' claims."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from vllm_server import post_json

from arbor.models import PRESETS
from arbor.models.hf import save_checkpoint_dir
from arbor.models.qwen3 import Qwen3ForCausalLM
from arbor.models.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PROMPTS = [TOK.encode(t) for t in ("reverse: abcdef", "hello vllm", "x")]


def padding_heavy_model() -> Qwen3ForCausalLM:
    """qwen3-tiny (head_dim 32, which vLLM's CPU attention accepts) with an untied head whose padding rows'
    logits are ~100 nats above the real ids' at every position: unmasked, every choice would be a padding id."""
    args = dataclasses.replace(PRESETS["qwen3-tiny"], tie_word_embeddings=False)
    model = Qwen3ForCausalLM(args)
    model.init_weights(0)
    with torch.no_grad():
        # Every embedding carries +100 in hidden unit 0, so the final hidden state's unit 0 is large and positive
        # whatever the token; padding rows read it (weight 10), real rows do not (weight 0).
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[TOK.vocab_size :, 0] = 10.0
        # The other units are ~100x smaller after the norm: real rows scaled up so their logits spread (~0.2 nats)
        # and the greedy choice among them is not a near-tie.
        model.lm_head.weight[: TOK.vocab_size, 1:] *= 300.0
    return model.eval()


def serve_padding_heavy_model(tmp_path: Path) -> tuple[Qwen3ForCausalLM, Path, dict[int, torch.Tensor]]:
    """The padding-heavy model, its checkpoint directory (for `vllm_server`) and its unmasked last-position logits
    per prompt, checked to put the first choice and >99% of the mass on padding rows."""
    model = padding_heavy_model()
    path = tmp_path / "padding-heavy"
    save_checkpoint_dir(model.state_dict(), model.args, path, TOK)
    logits = {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            logits[i] = model(torch.tensor([prompt]))[0, -1].float()
            assert int(logits[i].argmax()) >= TOK.vocab_size  # unmasked, the first choice is a padding row
            assert float(torch.log_softmax(logits[i], -1)[TOK.vocab_size :].exp().sum()) > 0.99
    return model, path, logits


def check_never_samples_a_padding_row(url: str, logits: dict[int, torch.Tensor]) -> None:
    """vLLM at `url` serving the padding-heavy model samples (greedy, and tempered at 1.0 and 0.7) and decodes only
    tokenizer ids, greedy picks the real ids' argmax, and each first token's logprob is the tempered distribution's
    renormalised over the real ids."""
    tokens, first = [], []
    for temperature in (0.0, 1.0, 0.7):
        for i, prompt in enumerate(PROMPTS):
            out = post_json(
                url,
                "/v1/completions",
                {
                    "prompt": prompt,
                    "max_tokens": 16,
                    "seed": i,
                    "n": 2 if temperature else 1,  # vLLM: greedy takes n = 1
                    "temperature": temperature,
                    "logprobs": 0,
                },
            )
            for c in out["choices"]:
                tokens += c["token_ids"]
                first.append((i, temperature, c["token_ids"][0], c["logprobs"]["token_logprobs"][0]))
    assert len(tokens) > 3 * 5 and all(t < TOK.vocab_size for t in tokens), sorted(set(tokens))
    for i, temperature, token, logprob in first:
        real = logits[i][: TOK.vocab_size]
        if temperature == 0.0:
            assert token == int(real.argmax())
        # vLLM's processed logprobs: the tempered distribution it sampled from, renormalised over the real ids
        expected = torch.log_softmax(real / (temperature or 1.0), -1)[token]
        assert abs(float(expected) - logprob) < 1e-3, (i, temperature, token, float(expected), logprob)
