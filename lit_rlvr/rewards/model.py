"""`reward=model`: a reward model, any local Hugging Face folder of a sequence-classification model with one
label (`AutoModelForSequenceClassification`, as TRL loads a reward model); its logit is the score.

    python train.py reward=model reward.options.path=/models/my-rm reward.options.device=cuda:1

Completions are scored `batch_size` at a time, each as its prompt followed by the completion (a chat prompt, a
list of messages, with the completion as the assistant's turn through the reward model's chat template when its
tokenizer has one), truncated on the left to `max_length` tokens. `device`: `auto` (the first GPU when there is one:
the trainer's device in a one-GPU run, else the CPU), or any torch device (`cpu`, `cuda:1`: a device of its own).
The model loads on the first batch, in `dtype`, in eval mode; a reward model never says malformed. A batch that
fails (out of memory, say) makes its completions malformed and counted, like any reward call.

What the folder holds is checked before any work, from its config.json alone (no weights read): a causal LM (whose
score head `AutoModelForSequenceClassification` would initialise at random, and train on noise) and a classifier
with another number of labels (whose head cannot load into one label) are refused in one line naming the path and
what was found. At load, a head missing from the weights (a config edited to say otherwise) is refused the same way.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from lit_rlvr.config.errors import RewardOptionError
from lit_rlvr.rewards.base import RewardResult
from lit_rlvr.rewards.checks import is_int, problem_line
from lit_rlvr.run.stop import STOP

DTYPES = ("float32", "bfloat16", "float16")
WEIGHT_FILES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
TOKENIZER_FILES = ("vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")  # beside tokenizer*.json


def model_problem(path: str) -> Optional[str]:
    """A line when config.json in `path` is not a sequence classifier with one label, naming what it is."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # an unknown model_type, a broken file
        return f"reward.options.path={path!r}: config.json is not a Hugging Face config ({type(err).__name__}: " \
               f"{str(err)[:200]})"
    found = list(getattr(config, "architectures", None) or [])
    if not any(name.endswith("ForSequenceClassification") for name in found):
        return (f"reward.options.path={path!r} holds {', '.join(found) or 'no architecture'} (config.json "
                "architectures), not a sequence-classification model: its score head would be initialised at "
                "random; give a reward model saved from AutoModelForSequenceClassification with one label")
    if config.num_labels != 1:
        return (f"reward.options.path={path!r} holds {found[0]} with {config.num_labels} labels (config.json "
                "id2label); a reward model has one label, whose logit is the score")
    if not any(name.endswith(WEIGHT_FILES) for name in os.listdir(path)):
        return (f"reward.options.path={path!r} holds a config.json and no weights (no *.safetensors or *.bin); "
                "save the model with save_pretrained")
    if not any(name.startswith("tokenizer") or name in TOKENIZER_FILES for name in os.listdir(path)):
        return (f"reward.options.path={path!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json): "
                "every call would fail; save the tokenizer there too (tokenizer.save_pretrained)")
    return None


class ModelReward:
    """See the module docstring."""

    def __init__(self, path: str, batch_size: int = 16, device: str = "auto", dtype: str = "float32",
                 max_length: int = 1024):
        problems = []
        if not isinstance(path, str) or not os.path.isfile(os.path.join(path, "config.json")):
            problems.append(problem_line("reward.options.path", path, "a local folder of a Hugging Face sequence-"
                                                                      "classification model (with config.json)"))
        if not is_int(batch_size, 1):
            problems.append(problem_line("reward.options.batch_size", batch_size, "an integer >= 1"))
        if not is_int(max_length, 1):
            problems.append(problem_line("reward.options.max_length", max_length, "an integer >= 1 (tokens)"))
        if dtype not in DTYPES:
            problems.append(problem_line("reward.options.dtype", dtype, f"one of {', '.join(DTYPES)}"))
        if not isinstance(device, str) or not device:
            problems.append(problem_line("reward.options.device", device, "auto, cpu or a torch device (cuda:1)"))
        if not problems:
            problems += [p for p in [model_problem(path)] if p]
        if problems:
            raise RewardOptionError(problems)
        self.path, self.batch_size, self.device, self.dtype = path, batch_size, device, dtype
        self.max_length = max_length
        self._model: Optional[Any] = None
        self._tokenizer: Optional[Any] = None

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> list[str]:
        if "path" not in options:
            return ["reward=model needs reward.options.path, a local folder of a sequence-classification model"]
        try:
            cls(**{k: v for k, v in options.items() if k in ("path", "batch_size", "device", "dtype", "max_length")})
        except RewardOptionError as err:
            return list(err.problems)
        return []

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:  # a folder that cannot load stops the run in one line, rather than failing every batch
            tokenizer = AutoTokenizer.from_pretrained(self.path)
            model, info = AutoModelForSequenceClassification.from_pretrained(self.path, num_labels=1,
                                                                             dtype=getattr(torch, self.dtype),
                                                                             output_loading_info=True)
        except Exception as err:  # OSError, ValueError; a SafetensorError (a truncated file), a RuntimeError (shapes)
            raise RewardOptionError([f"reward.options.path={self.path!r}: the reward model cannot be loaded "
                                     f"({type(err).__name__}: {str(err)[:300]})"]) from err
        tokenizer.truncation_side = "left"  # keep the completion's end: where the answer is
        if info["missing_keys"]:  # initialised at random: its scores would be noise
            raise RewardOptionError([f"reward.options.path={self.path!r}: the weights hold no "
                                     f"{', '.join(sorted(info['missing_keys'])[:3])} (the score head of "
                                     f"{type(model).__name__}); give a reward model saved with its head"])
        if model.config.pad_token_id is None:  # the classifier reads the last non-pad token
            model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
                else tokenizer.eos_token_id
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._model, self._tokenizer = model.to(device).eval().requires_grad_(False), tokenizer

    def _text(self, prompt: Any, completion: str) -> str:
        if isinstance(prompt, list) and getattr(self._tokenizer, "chat_template", None):
            return self._tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": completion}],
                                                       tokenize=False)
        if isinstance(prompt, list):
            prompt = "".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in prompt)
        return f"{prompt}{completion}"

    def __call__(self, prompt: Any, completion: str, answer: Any) -> float:
        return self.score_batch([prompt], [completion], [answer])[0]

    def score_batch(self, prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any]) -> list:
        import torch

        if self._model is None:
            self._load()
        texts = [self._text(p, c) for p, c in zip(prompts, completions)]
        scores: list = []
        for start in range(0, len(texts), self.batch_size):
            STOP.check()  # a stop past its grace does not wait for the batch's remaining forward passes
            chunk = texts[start:start + self.batch_size]
            try:
                inputs = self._tokenizer(chunk, return_tensors="pt", padding=True, truncation=True,
                                         max_length=self.max_length).to(self._model.device)
                with torch.inference_mode():
                    logits = self._model(**inputs).logits  # [B, 1]
                scores.extend(logits[:, 0].float().cpu().tolist())
            except Exception as err:  # e.g. out of memory: this chunk's completions, not the run
                why = f"error: reward model {self.path}: {type(err).__name__}: {str(err)[:300]}"
                scores.extend([RewardResult(-1.0, True, why)] * len(chunk))
        return scores

    def close(self) -> None:
        self._model = self._tokenizer = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None, "_tokenizer": None}
