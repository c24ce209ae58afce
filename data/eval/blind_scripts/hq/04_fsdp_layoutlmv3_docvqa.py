"""Extractive DocVQA with LayoutLMv3-large, sharded with FSDP.

OCR is precomputed (one jsonl record per question):
  {"id": "q_49153", "image": "imgs/ffbf0023_4.png", "question": "...", "answers": ["..."],
   "words": [...], "boxes": [[x0, y0, x1, y1], ...] (0-1000), "start_word": 17, "end_word": 19}

    torchrun --nproc_per_node=8 04_fsdp_layoutlmv3_docvqa.py --data /data/docvqa_ocr --epochs 8
"""
import argparse
import functools
import json
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3ForQuestionAnswering, LayoutLMv3Processor, get_linear_schedule_with_warmup
from transformers.models.layoutlmv3.modeling_layoutlmv3 import LayoutLMv3Layer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="microsoft/layoutlmv3-large")
    ap.add_argument("--save_dir", default="ckpt/lmv3_docvqa_fsdp")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


def nls(a, b):
    a, b = a.lower().strip(), b.lower().strip()
    if not a and not b:
        return 0.0
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            cur = d[j]
            d[j] = min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev = cur
    return d[len(b)] / max(len(a), len(b))


def anls(pred, answers, tau=0.5):
    return max((1 - nls(pred, gt)) if nls(pred, gt) < tau else 0.0 for gt in answers)


class DocVQAExtractive(Dataset):
    def __init__(self, root, split, processor, max_len):
        self.root = root
        self.processor = processor
        self.max_len = max_len
        with open(os.path.join(root, f"{split}.jsonl")) as f:
            self.recs = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, idx):
        r = self.recs[idx]
        image = Image.open(os.path.join(self.root, r["image"])).convert("RGB")
        enc = self.processor(
            image, r["question"], r["words"], boxes=r["boxes"],
            truncation="only_second", max_length=self.max_len, padding="max_length", return_tensors="pt",
        )
        word_ids = enc.word_ids(0)
        seq_ids = enc.sequence_ids(0)
        start_pos = end_pos = 0
        for t, (w, s) in enumerate(zip(word_ids, seq_ids)):
            if s != 1 or w is None:
                continue
            if w == r.get("start_word", -1) and start_pos == 0:
                start_pos = t
            if w == r.get("end_word", -1):
                end_pos = t
        if end_pos < start_pos:
            start_pos = end_pos = 0
        item = {k: v.squeeze(0) for k, v in enc.items()}
        item["start_positions"] = torch.tensor(start_pos)
        item["end_positions"] = torch.tensor(end_pos)
        item["context_word_ids"] = torch.tensor(
            [w if (w is not None and s == 1) else -1 for w, s in zip(word_ids, seq_ids)]
        )
        item["idx"] = torch.tensor(idx)
        return item


def decode_answer(start_logits, end_logits, word_ids, words, max_answer_tokens=30):
    valid = word_ids >= 0
    s_log = start_logits.masked_fill(~valid, -1e4)
    e_log = end_logits.masked_fill(~valid, -1e4)
    top_s = s_log.topk(10).indices.tolist()
    top_e = e_log.topk(10).indices.tolist()
    best, best_span = -1e9, None
    for s in top_s:
        for e in top_e:
            if e < s or e - s + 1 > max_answer_tokens or not valid[s] or not valid[e]:
                continue
            score = s_log[s].item() + e_log[e].item()
            if score > best:
                best, best_span = score, (s, e)
    if best_span is None:
        return ""
    w0, w1 = word_ids[best_span[0]].item(), word_ids[best_span[1]].item()
    return " ".join(words[w0:w1 + 1])


@torch.no_grad()
def evaluate(model, loader, dataset):
    model.eval()
    local = []
    for batch in loader:
        idx = batch.pop("idx")
        word_ids = batch.pop("context_word_ids")
        batch.pop("start_positions")
        batch.pop("end_positions")
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        out = model(**batch)
        for i in range(idx.size(0)):
            rec = dataset.recs[idx[i].item()]
            pred = decode_answer(out.start_logits[i].float().cpu(), out.end_logits[i].float().cpu(),
                                 word_ids[i], rec["words"])
            local.append((idx[i].item(), anls(pred, rec["answers"])))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    # the sampler pads the last batch with repeated samples, count each question once
    scores = {}
    for part in gathered:
        for i, s in part:
            scores[i] = s
    model.train()
    return sum(scores.values()) / max(len(scores), 1), len(scores)


def save_full_checkpoint(model, path, rank):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    dist.barrier()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    processor = LayoutLMv3Processor.from_pretrained(args.model, apply_ocr=False)
    train_ds = DocVQAExtractive(args.data, "train", processor, args.max_len)
    val_ds = DocVQAExtractive(args.data, "val", processor, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                          num_workers=args.workers, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=16, sampler=val_sampler, num_workers=args.workers)

    model = LayoutLMv3ForQuestionAnswering.from_pretrained(args.model)
    wrap_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LayoutLMv3Layer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap_policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
        limit_all_gathers=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total), total)

    best = -1.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch.pop("idx")
            batch.pop("context_word_ids")
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                print(f"[ep {epoch} it {step}/{len(train_dl)}] loss={loss.item():.4f} "
                      f"lr={scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        val_anls, n = evaluate(model, val_dl, val_ds)
        if rank == 0:
            print(f"epoch {epoch}: val ANLS {val_anls:.4f} over {n} questions", flush=True)
        if val_anls > best:
            best = val_anls
            save_full_checkpoint(model, os.path.join(args.save_dir, "best_model.pt"), rank)

    if rank == 0:
        processor.save_pretrained(args.save_dir)
        print(f"best ANLS {best:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
