"""Spoken prompts without a dataset: sentences of texts that ship already, spoken by espeak-ng, for Whisper.

Two sets, from different texts so that a draft trained on one is measured on the other:

- ``speech`` (measurement): sentences of the MT-bench questions (:func:`~tetris_hf.tools.data.load_mtbench`);
- ``speech-train`` (fitting): sentences of the human turns of ShareGPT's fitting side
  (:func:`~tetris_hf.tools.data.sharegpt_fitting_chats`, never read by a measurement set).

Each sentence (6 to 40 words, plain prose characters) is spoken by ``espeak-ng`` in one of a few voices and speeds
(:data:`VOICES`, :data:`SPEEDS`, taken in turn) and resampled by ``sox`` to 16 kHz mono, 16-bit: short-form audio
(under 30 s, checked). The set is built once into a cache folder (``$TETRIS_HF_CACHE/whisper/<set>``: one WAV per
utterance and ``manifest.jsonl`` with its text, voice, speed and length) and read from there afterwards.

Synthetic speech is easier than real speech: word error rates measured on it say the model is real and working, not
how it does on people.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOICES = ("en-us", "en", "en-us+f3", "en+m3")
SPEEDS = (150, 175, 200)  # words per minute (espeak-ng -s)
SAMPLING_RATE = 16000
MAX_SECONDS = 30.0
MIN_WORDS, MAX_WORDS = 6, 40
SPEECH_SETS = ("speech", "speech-train")
_PROSE = re.compile(r"^[A-Za-z][A-Za-z ,.'?!;:-]*[.?!]?$")


@dataclass(frozen=True)
class Utterance:
    """One spoken sentence: ``text`` spoken by ``voice`` at ``speed`` words a minute into ``path`` (``seconds``)."""

    id: str
    text: str
    voice: str
    speed: int
    seconds: float
    path: Path

    def audio(self) -> np.ndarray:
        """``(samples,)`` float32 in [-1, 1] at 16 kHz."""
        return read_wav(self.path)


def sentences(text: str) -> list[str]:
    """The prose sentences of ``text`` that fit one utterance (:data:`MIN_WORDS` to :data:`MAX_WORDS` words of
    letters and ordinary punctuation)."""
    found = []
    for sentence in re.split(r"(?<=[.?!])\s+|\n+", text):
        sentence = " ".join(sentence.split())
        if _PROSE.match(sentence) and MIN_WORDS <= len(sentence.split()) <= MAX_WORDS:
            found.append(sentence)
    return found


def texts_of(set_name: str, count: int, strict: bool = True) -> list[tuple[str, str]]:
    """``count`` ``(id, sentence)`` pairs of the set ``set_name`` (:data:`SPEECH_SETS`), in a fixed order, each sentence
    once (fewer, without ``strict``, when the texts hold fewer)."""
    from .data import load_mtbench, sharegpt_fitting_chats

    if set_name == "speech":
        sources = [(prompt.id, prompt.messages[0]["content"]) for prompt in load_mtbench()]
    elif set_name == "speech-train":
        chats, _ = sharegpt_fitting_chats()
        sources = [(prompt.id, message["content"]) for prompt in chats for message in prompt.messages
                   if message["role"] == "user"]
    else:
        raise ValueError(f"unknown speech set {set_name!r}; known: {', '.join(SPEECH_SETS)}")
    picked, seen = [], set()
    for source_id, text in sources:
        for index, sentence in enumerate(sentences(text)):
            if sentence.lower() not in seen:
                seen.add(sentence.lower())
                picked.append((f"{source_id}/{index}", sentence))
                if len(picked) == count:
                    return picked
    if len(picked) < count and strict:
        raise ValueError(f"the {set_name} texts hold {len(picked)} usable sentences, fewer than {count}")
    return picked


def check_tools() -> None:
    """espeak-ng and sox must be installed (a ``FileNotFoundError`` naming the fix otherwise)."""
    missing = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(f"{' and '.join(missing)} not found: `apt-get install -y espeak-ng sox`")


def speak(text: str, voice: str, speed: int, path: Path) -> float:
    """Speak ``text`` into ``path`` (16 kHz mono 16-bit WAV); returns its length in seconds."""
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "raw.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), text], check=True,
                       capture_output=True)
        subprocess.run(["sox", str(raw), "-r", str(SAMPLING_RATE), "-c", "1", "-b", "16", str(path)], check=True,
                       capture_output=True)
    with wave.open(str(path)) as audio:
        return audio.getnframes() / audio.getframerate()


def read_wav(path: str | Path) -> np.ndarray:
    """A 16-bit mono WAV as float32 in [-1, 1]."""
    with wave.open(str(path)) as audio:
        if audio.getsampwidth() != 2 or audio.getnchannels() != 1:
            raise ValueError(f"{path}: expected 16-bit mono audio")
        samples = np.frombuffer(audio.readframes(audio.getnframes()), dtype=np.int16)
    return samples.astype(np.float32) / 32768.0


def load_speech(set_name: str = "speech", count: int = 64, folder: str | Path | None = None) -> list[Utterance]:
    """``count`` utterances of ``set_name``, built with espeak-ng and sox at the first call (a few seconds per
    hundred), then read from the cache folder; a folder built for fewer utterances is extended."""
    from .whisper_ct2 import whisper_cache_dir

    folder = Path(folder) if folder is not None else whisper_cache_dir() / set_name
    manifest = folder / "manifest.jsonl"
    known = []
    if manifest.is_file():
        known = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    if len(known) < count:
        check_tools()
        folder.mkdir(parents=True, exist_ok=True)
        for index, (text_id, text) in enumerate(texts_of(set_name, count)):
            if index < len(known):
                continue
            voice, speed = VOICES[index % len(VOICES)], SPEEDS[(index // len(VOICES)) % len(SPEEDS)]
            path = folder / f"{index:04d}.wav"
            seconds = speak(text, voice, speed, path)
            if seconds > MAX_SECONDS:
                raise ValueError(f"{path}: {seconds:.1f} s of speech, over Whisper's {MAX_SECONDS:.0f} s window")
            known.append({"id": text_id, "text": text, "voice": voice, "speed": speed, "seconds": round(seconds, 3),
                          "file": path.name})
        manifest.write_text("".join(json.dumps(record) + "\n" for record in known))
    return [Utterance(record["id"], record["text"], record["voice"], record["speed"], record["seconds"],
                      folder / record["file"]) for record in known[:count]]


def feature_extractor():
    """Whisper's log-mel features (80 bins, 30 s windows), built from its defaults: no download."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLING_RATE)


def input_features(utterances: list[Utterance], extractor=None):
    """``(B, 80, 3000)`` float32 features of the utterances (each padded to 30 s)."""
    extractor = extractor or feature_extractor()
    return extractor([utterance.audio() for utterance in utterances], sampling_rate=SAMPLING_RATE,
                     return_tensors="pt").input_features


def normalize(text: str) -> list[str]:
    """Words for a word error rate: lower case, punctuation dropped (apostrophes kept inside words)."""
    text = re.sub(r"[^a-z0-9' ]+", " ", text.lower().replace("-", " "))
    return [word.strip("'") for word in text.split() if word.strip("'")]


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """``(edits, reference words)``: the word-level Levenshtein distance after :func:`normalize`."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    previous = list(range(len(hyp) + 1))
    for i, word in enumerate(ref, start=1):
        current = [i] + [0] * len(hyp)
        for j, other in enumerate(hyp, start=1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (word != other))
        previous = current
    return previous[-1], len(ref)


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER: all edits over all reference words."""
    edits = words = 0
    for reference, hypothesis in zip(references, hypotheses):
        e, n = word_errors(reference, hypothesis)
        edits, words = edits + e, words + n
    return edits / max(words, 1)
