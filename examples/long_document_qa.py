"""Import a long document into a ctxfs store once, then answer several questions about it
with transformers' generate(): each question prefills only its own tokens, and every decode
step's attention over the document is answered from the store.

    bash tools/python-env.sh            # builds the package into target/venv
    target/venv/bin/python examples/long_document_qa.py [--tokens 4096] [--store qa.ctxfs]

Prints, per question, the answer and the time to first token reusing the stored document
beside the time of a full prefill of document and question.
"""

import argparse
import os
import time

import torch

import ctxfs
import ctxfs.hf as hf
from ctxfs import texts

QUESTIONS = [
    "What does the with statement do?",
    "What is a decorator?",
    "How does a for loop end?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="document length in tokens (at most 8192)")
    ap.add_argument("--store", default="qa.ctxfs", help="store file (formatted when missing)")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    tok, model = hf.load_smollm2()
    doc = tok(texts.text("prose"), return_tensors="pt").input_ids[:, : args.tokens]
    if os.path.exists(args.store):
        store = ctxfs.Store.open(args.store)
    else:
        store = ctxfs.Store.create(args.store, size=2 << 30)
    if "doc" not in [c["name"] for c in store.contexts()]:
        started = time.monotonic()
        hf.import_prefix(model, doc, store, "doc")
        print(f"imported {doc.shape[1]} tokens in {time.monotonic() - started:.1f} s")

    for question in QUESTIONS:
        q = tok(f"\nQuestion: {question}\nAnswer:", return_tensors="pt").input_ids
        prompt = torch.cat([doc, q], 1)
        # Without reuse: transformers prefills document and question, then gives a token.
        model.set_attn_implementation("sdpa")
        started = time.monotonic()
        with torch.no_grad():
            model(prompt)
        full = time.monotonic() - started
        # With reuse: only the question is prefilled; the document is attended from the store.
        hf.use_ctxfs(model)
        cache = hf.CtxfsCache(store, prompt)
        started = time.monotonic()
        first = model.generate(prompt, cache=cache, max_new_tokens=1, do_sample=False)
        ttft = time.monotonic() - started
        out = model.generate(
            first, cache=cache, max_new_tokens=args.new_tokens - 1, do_sample=False
        )
        answer = tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True).strip()
        print(f"\nQ: {question}\nA: {answer}")
        print(f"time to first token: {ttft:.2f} s reusing the stored document, {full:.2f} s with a full prefill "
              f"({full / ttft:.1f}x sooner); plans {cache.session.stats()['plans']}")


if __name__ == "__main__":
    main()
