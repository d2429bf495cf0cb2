"""Child process: vLLM's offline engine (``vllm.LLM``) on requests given as tensors.

Usage: ``python offline_vllm.py MODEL_DIR REQUESTS.npz OUT.json``. Each request in the npz is a set
of arrays named ``<r>/<item>/<key>`` plus ``<r>/meta`` (JSON: prompt token ids, per item the modality,
its field layout, placeholder and identity, and the sampling controls). The tensors go to the engine
as a preprocessed ``mm_input``, exactly as a gRPC server hands them over. A request whose meta says
``raw`` instead holds source media (``<r>/<item>/media``: an HxWx3 image, a TxHxWx3 video or an audio
waveform; a video's metadata or a clip's sample rate in the meta's ``metadata``) and
prompt token ids with one placeholder per item: ``LLM.generate`` processes them itself, with vLLM's
own processor. The outputs (token ids and the chosen tokens' logprobs) are written as JSON.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from shmtransport.engine import environment, process


def _prompt(meta: dict, arrays: dict):
    import torch
    from vllm.inputs.engine import mm_input
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalFlatField,
        MultiModalKwargsItem,
        MultiModalKwargsItems,
        PlaceholderRange,
    )

    items, hashes, placeholders = {}, {}, {}
    for i, item in enumerate(meta["items"]):
        elems = {}
        for key, field in item["fields"].items():
            data = torch.from_numpy(np.ascontiguousarray(arrays[f"{i}/{key}"]))
            if field["kind"] == "flat":
                vfield = MultiModalFlatField(slices=[slice(a, b) for a, b in field["slices"]], dim=field["dim"],
                                             keep_on_cpu=field["keep_on_cpu"])
            else:
                vfield = MultiModalBatchedField(keep_on_cpu=field["keep_on_cpu"])
            elems[key] = MultiModalFieldElem(data=data, field=vfield)
        items.setdefault(item["modality"], []).append(MultiModalKwargsItem(elems))
        hashes.setdefault(item["modality"], []).append(item["mm_hash"])
        placeholders.setdefault(item["modality"], []).append(PlaceholderRange(offset=item["offset"],
                                                                              length=item["length"]))
    return mm_input(prompt_token_ids=meta["token_ids"], mm_kwargs=MultiModalKwargsItems(items), mm_hashes=hashes,
                    mm_placeholders=placeholders)


def _raw_prompt(meta: dict, arrays: dict) -> dict:
    from PIL import Image

    media: dict[str, list] = {}
    for i, modality in enumerate(meta["modalities"]):
        source = arrays[f"{i}/media"]
        if modality == "image":
            source = Image.fromarray(source)
        elif str(i) in meta.get("metadata", {}):
            source = (source, meta["metadata"][str(i)])
        media.setdefault(modality, []).append(source)
    return {"prompt_token_ids": meta["token_ids"], "multi_modal_data": media}


def main(model_dir: str, requests_path: str, out_path: str) -> int:
    environment.apply_defaults(environment.isolated_environment())
    from vllm import LLM, SamplingParams

    flags = dict(zip(process.ENGINE_FLAGS[::2], process.ENGINE_FLAGS[1::2]))
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=int(flags["--max-model-len"]),
              max_num_seqs=int(flags["--max-num-seqs"]), max_num_batched_tokens=int(flags["--max-num-batched-tokens"]),
              enforce_eager=True, limit_mm_per_prompt=json.loads(flags["--limit-mm-per-prompt"]))
    data = np.load(requests_path)
    names = sorted({k.split("/", 1)[0] for k in data.files})
    results = {}
    for name in names:
        meta = json.loads(bytes(data[f"{name}/meta"]).decode())
        arrays = {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(name + "/") and k != f"{name}/meta"}
        params = SamplingParams(temperature=0.0, max_tokens=meta["max_tokens"], logprobs=meta["logprobs"])
        if meta.get("raw"):
            out = llm.generate([_raw_prompt(meta, arrays)], params, use_tqdm=False)[0].outputs[0]
        else:
            # LLM.generate would take this dict for a text prompt and drop the tensors: hand the
            # engine the processed input directly, as a server does
            llm.llm_engine.add_request(name, _prompt(meta, arrays), params)
            finished = []
            while llm.llm_engine.has_unfinished_requests():
                finished += [o for o in llm.llm_engine.step() if o.finished]
            out = finished[0].outputs[0]
        results[name] = {"token_ids": list(out.token_ids),
                         "logprobs": [entry[t].logprob for t, entry in zip(out.token_ids, out.logprobs)]}
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
