"""The UI-TARS prompt as chat messages, token-exact multi-turn conversations, and what every policy
backend shares about a checkpoint (coordinate convention, resize limits, special tokens).

A conversation is a system line, a user turn with the prompt and instruction, then one user turn
per screenshot, each followed by the assistant's sampled response. `TokenConversation` builds the
token ids incrementally with the model's own processor and chat template: the ids of a sampled
response are appended exactly as sampled (no decode/re-encode), so the trainer computes log-probs
of precisely the tokens the policy produced ("token-in/token-out"), and each screenshot is run
through the image processor once.

History limit: at most `history_images` screenshots stay in the context; older steps keep their
responses as text only. Dropping an image changes the prefix, so the conversation then starts a
new *segment*: a fresh rendering of the shortened history. Every segment is a training sequence
in which each trained token was sampled with exactly that sequence as its prefix. With
history_images >= max_steps (ARPO's 15/15) a trajectory is one segment.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from arpo_lib.actions import MAX_PIXELS, MIN_PIXELS, ParsedResponse, parse_response, smart_resize
from arpo_lib.agent.prompt_library import PROMPTS, Prompt
from arpo_lib.types import Segment  # lives in types; `arpo_lib.agent.prompt.Segment` keeps working

log = logging.getLogger(__name__)

DEFAULT_PROMPT = "uitars_official"
"""The prompt a policy uses unless `agent.prompt` names another (see prompt_library)."""


def get_prompt(name: str | Prompt) -> Prompt:
    """A prompt by name; ValueError naming the known ones."""
    if isinstance(name, Prompt):
        return name
    return PROMPTS[name]  # an unknown name: ValueError naming the registered prompts


def initial_messages(instruction: str, prompt: str | Prompt = DEFAULT_PROMPT) -> list[dict[str, Any]]:
    """System line + the computer-use prompt with the instruction (no screenshot yet)."""
    p = get_prompt(prompt)
    return [
        {"role": "system", "content": [{"type": "text", "text": p.system}]},
        {"role": "user", "content": [{"type": "text", "text": p.render(instruction)}]},
    ]


def build_messages(instruction: str, n_screenshots: int, responses: list[str], history_images: int,
                   prompt: str | Prompt = DEFAULT_PROMPT) -> list[dict[str, Any]]:
    """Chat messages for a step: screenshots as image placeholders, only the newest
    `history_images` kept; older steps keep their responses as text. `responses[i]` follows
    screenshot i; the list is one shorter than the screenshots when a response is due."""
    messages = initial_messages(instruction, prompt)
    first_kept = max(0, n_screenshots - history_images)
    for i in range(n_screenshots):
        if i >= first_kept:
            messages.append({"role": "user", "content": [{"type": "image"}]})
        if i < len(responses):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": responses[i]}]})
    return messages


class TokenConversation:
    """Token-exact multi-turn UI-TARS conversation for one episode."""

    def __init__(self, processor: Any, instruction: str, history_images: int = 15,
                 prompt: str | Prompt = DEFAULT_PROMPT):
        self.processor = processor
        self.instruction = instruction
        self.history_images = history_images
        self.prompt = get_prompt(prompt)
        self.responses: list[str] = []
        self.screenshots: list[Image.Image] = []
        self.segments: list[Segment] = []
        self._images_in_segment = 0
        self.eos_id: int = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")

    # -- rendering helpers -------------------------------------------------------------
    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str, images: list[Image.Image]) -> dict[str, Any]:
        enc = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        mm = enc.get("mm_token_type_ids")
        mm_types = mm[0].tolist() if mm is not None else [0] * len(ids)
        return {"ids": ids, "mm": mm_types, "pixel_values": enc.get("pixel_values"), "grid": enc.get("image_grid_thw")}

    def _add_images(self, seg: Segment, enc: dict[str, Any], steps: list[int]) -> None:
        if not steps:
            return
        grids = enc["grid"]
        sizes = [int(torch.prod(g)) for g in grids]
        for chunk, grid, step in zip(torch.split(enc["pixel_values"], sizes), grids, steps):
            seg.pixel_values.append(chunk)
            seg.image_grid_thw.append(grid)
            seg.screenshot_steps.append(step)

    # -- the two operations of a rollout ------------------------------------------------
    def add_observation(self, screenshot: Image.Image) -> None:
        """Append the next screenshot as a user turn and open the assistant turn."""
        step = len(self.screenshots)
        self.screenshots.append(screenshot)
        n = len(self.screenshots)
        if not self.segments or self._images_in_segment >= self.history_images:
            # First turn, or the oldest image must go: render the kept history as a new segment.
            messages = build_messages(self.instruction, n, self.responses, self.history_images, self.prompt)
            first_kept = max(0, n - self.history_images)
            enc = self._encode(self._render(messages, True), self.screenshots[first_kept:])
            seg = Segment()
            seg.extend(enc["ids"], enc["mm"], mask=0)
            self._add_images(seg, enc, list(range(first_kept, n)))
            self.segments.append(seg)
            self._images_in_segment = n - first_kept
            return
        # Incremental: the new turn's text is the template's rendering with the turn minus without it.
        before = build_messages(self.instruction, n - 1, self.responses, self.history_images + 1, self.prompt)
        after = build_messages(self.instruction, n, self.responses, self.history_images + 1, self.prompt)
        prefix, full = self._render(before, False), self._render(after, True)
        # Cut the prefix right after the last response's <|im_end|>, which was sampled and is
        # already in the ids; what follows it (a newline, the user turn, the assistant header) is new.
        cut = prefix.rfind("<|im_end|>") + len("<|im_end|>")
        if cut < len("<|im_end|>") or not full.startswith(prefix[:cut]):
            raise RuntimeError("chat template is not prefix-stable; cannot extend the conversation incrementally")
        turn = full[cut:]
        seg = self.segments[-1]
        enc = self._encode(turn, [screenshot])
        seg.extend(enc["ids"], enc["mm"], mask=0)
        self._add_images(seg, enc, [step])
        self._images_in_segment += 1

    def add_response(self, text: str, token_ids: list[int], logprobs: list[float]) -> None:
        """Append the sampled response tokens exactly as sampled (trained on, mask 1)."""
        if len(token_ids) != len(logprobs):
            raise ValueError("token_ids and logprobs differ in length")
        seg = self.segments[-1]
        seg.extend(list(token_ids), [0] * len(token_ids), mask=1, logprobs=list(logprobs))
        if not token_ids or token_ids[-1] != self.eos_id:
            # Cut at max_new_tokens: close the turn so the next one is well-formed (not trained on).
            seg.extend([self.eos_id], [0], mask=0)
        self.responses.append(text)

    @property
    def current(self) -> Segment:
        return self.segments[-1]


# ----------------------------------------------------------------------------- per checkpoint

QWEN_IMAGE_PROCESSORS = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2_5_VLImageProcessor")
"""Names UI-TARS checkpoints give their image processor; Qwen2.5-VL's is Qwen2-VL's under another name."""


def _normalised_image_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A Qwen-VL image processor config that this transformers loads and resizes with, and notes
    on what was changed: the `Qwen2_5_VLImageProcessor` name (gone from transformers 5) and a
    `size: {min_pixels, max_pixels}` (its resize wants shortest_edge / longest_edge)."""
    fixed, notes = dict(config), []
    kind = fixed.get("image_processor_type")
    if kind == "Qwen2_5_VLImageProcessor":
        fixed["image_processor_type"] = "Qwen2VLImageProcessor"
        notes.append("image_processor_type Qwen2_5_VLImageProcessor loaded as Qwen2VLImageProcessor (the same class "
                     "in transformers 4, removed in 5)")
    size = fixed.get("size")
    if isinstance(size, dict) and "min_pixels" in size and "shortest_edge" not in size:
        fixed["size"] = {"shortest_edge": int(size["min_pixels"]), "longest_edge": int(size["max_pixels"])}
        notes.append(f"size {{min_pixels: {size['min_pixels']}, max_pixels: {size['max_pixels']}}} read as "
                     "shortest_edge / longest_edge")
    return fixed, notes


def load_processor(path: str | Path) -> Any:
    """The checkpoint's processor (tokenizer, chat template, image processor) through
    `AutoProcessor`, also for UI-TARS / Qwen2.5-VL checkpoints whose preprocessor_config.json
    transformers 5 refuses or misreads (`_normalised_image_config`): those load from a directory
    of links to the checkpoint's files with a corrected preprocessor_config.json, and what was
    adapted is logged. A policy saved afterwards writes the corrected config."""
    from transformers import AutoProcessor
    from transformers.image_processing_utils import ImageProcessingMixin

    try:
        config, _ = ImageProcessingMixin.get_image_processor_dict(str(path))
    except (OSError, ValueError):
        config = {}
    fixed, notes = _normalised_image_config(config)
    if not notes or config.get("image_processor_type") not in QWEN_IMAGE_PROCESSORS:
        return AutoProcessor.from_pretrained(str(path))
    log.info("%s: %s", path, "; ".join(notes))
    return AutoProcessor.from_pretrained(str(_corrected_processor_dir(Path(path), fixed)))


def _corrected_processor_dir(path: Path, image_config: dict[str, Any]) -> Path:
    """A directory holding links to the checkpoint's processor files and `image_config` as its
    preprocessor_config.json (cached by content under ~/.cache/arpo-workbench/processors)."""
    import hashlib
    import json
    import os
    import tempfile

    if not path.is_dir():  # a hub id: its small files, from the local Hugging Face cache or the hub
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.jinja", "*.txt", "*.model"]))
    text = json.dumps(image_config, indent=2, sort_keys=True)
    key = hashlib.sha256(f"{path.resolve()}\n{text}".encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arpo-workbench" / "processors"
    target = cache / key
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-"))
    for f in path.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".bin", ".pt", ".pth") and f.name != "preprocessor_config.json":
            (tmp / f.name).symlink_to(f.resolve())
    (tmp / "preprocessor_config.json").write_text(text)
    try:
        os.replace(tmp, target)
    except OSError:  # another process made it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def response_text(tokenizer: Any, token_ids: list[int], end_ids: list[int]) -> str:
    """The text of sampled response tokens as it goes back into the history: every token kept,
    box markers included (`<|box_start|>`, special tokens in the real Qwen tokenizer that
    `skip_special_tokens` would strip), only the end-of-turn token dropped (the chat template
    writes it). Re-encoding this text gives the sampled special tokens back."""
    ids = list(token_ids)
    while ids and ids[-1] in end_ids:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)



COORD_MODE_BY_MODEL_TYPE = {"qwen2_vl": "qwen2vl", "qwen2_5_vl": "qwen25vl"}


def coord_mode_for(path: str | Path) -> str:
    """The UI-TARS coordinate convention of a checkpoint, from its architecture."""
    from transformers import AutoConfig

    return COORD_MODE_BY_MODEL_TYPE.get(AutoConfig.from_pretrained(str(path)).model_type, "qwen25vl")


def image_processor_limits(processor: Any) -> tuple[int, int, int]:
    """(factor, min_pixels, max_pixels) the image processor really resizes with."""
    ip = processor.image_processor
    size = getattr(ip, "size", None) or {}
    min_pixels = getattr(ip, "min_pixels", None) or size.get("shortest_edge") or MIN_PIXELS
    max_pixels = getattr(ip, "max_pixels", None) or size.get("longest_edge") or MAX_PIXELS
    factor = int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2))
    return factor, int(min_pixels), int(max_pixels)


QWEN_DEFAULT_MAX_PIXELS = 16384 * 28 * 28
"""Qwen2.5-VL's and UI-TARS-1.5's max_pixels: a 1080p screenshot is not downscaled."""


def checkpoint_image_limits(path: str | Path) -> tuple[int, int, int] | None:
    """(factor, min_pixels, max_pixels) from a checkpoint's preprocessor_config.json, read without
    loading the processor or reaching the network (config checks run before anything starts): a
    local directory, or a hub id already in the Hugging Face cache; None when neither has it."""
    import json

    file = Path(path) / "preprocessor_config.json"
    if not file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(path), "preprocessor_config.json")
        except Exception:  # not a hub id (a missing directory, a malformed name)
            cached = None
        if not isinstance(cached, str):
            return None
        file = Path(cached)
    try:
        config, _ = _normalised_image_config(json.loads(file.read_text()))
    except (OSError, ValueError):
        return None
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    min_pixels = config.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS
    max_pixels = config.get("max_pixels") or size.get("longest_edge") or QWEN_DEFAULT_MAX_PIXELS
    factor = int(config.get("patch_size", 14)) * int(config.get("merge_size", 2))
    return factor, int(min_pixels), int(max_pixels)


def screenshot_tokens(size: tuple[int, int], limits: tuple[int, int, int]) -> int:
    """Context tokens one screenshot of `size` (width, height) costs under the image processor's
    (factor, min_pixels, max_pixels): one token per factor x factor block of the smart-resized
    image, plus <|vision_start|> and <|vision_end|>. 1920x1080 at UI-TARS's limits: 39 x 69 + 2."""
    factor, min_pixels, max_pixels = limits
    height, width = smart_resize(size[1], size[0], factor, min_pixels, max_pixels)
    return (height // factor) * (width // factor) + 2


def special_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(end-of-turn ids, ids a response must never contain). A response may never contain vision
    tokens: a random or weak model can sample them, and the training forward pass would then
    expect image features for them."""
    eos = [i for i in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>"))
           if i is not None]
    suppress = [i for i in tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"])
        if i is not None and i != tokenizer.unk_token_id]
    return eos, suppress


class UITarsConversations:
    """What every policy backend shares: conversations built with the model's processor and
    prompt, and responses parsed in the model's coordinate convention. Needs `processor`,
    `history_images`, `prompt`, `coord_mode` and `resize` on the instance."""

    prompt: Prompt = PROMPTS[DEFAULT_PROMPT]

    def new_conversation(self, instruction: str) -> TokenConversation:
        return TokenConversation(self.processor, instruction, history_images=self.history_images, prompt=self.prompt)

    def release(self, key: Any) -> None:
        """Forget an episode's state; nothing is kept per episode unless a backend says so."""

    def parse(self, text: str, image_size: tuple[int, int], rules: str = "workbench") -> ParsedResponse:
        """Parse a response with this model's coordinate convention and resize limits, under the
        named action rules (`arpo_lib.actions.ACTION_RULES`)."""
        factor, min_pixels, max_pixels = self.resize
        return parse_response(text, image_size, coord_mode=self.coord_mode,
                              factor=factor, min_pixels=min_pixels, max_pixels=max_pixels, rules=rules)
