"""Extractive DocVQA with LayoutLMv3-large, sharded with FSDP.

Input: jsonl produced by scripts/docvqa_ocr.py (Textract OCR), one question per line:
  {"qid", "image", "question", "words", "boxes" (0-1000), "answers": [...], "start_word", "end_word"}

    torchrun --nproc_per_node=8 14_docvqa_layoutlmv3_fsdp.py --train data/docvqa/train.jsonl --val data/docvqa/val.jsonl
"""
import argparse
import functools
import json
import os

import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3ForQuestionAnswering, LayoutLMv3Processor, get_cosine_schedule_with_warmup
from transformers.models.layoutlmv3.modeling_layoutlmv3 import LayoutLMv3Layer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--model", default="microsoft/layoutlmv3-large")
    ap.add_argument("--out", default="ckpt/docvqa_v3_large")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--workers", type=int, default=6)
    return ap.parse_args()


def levenshtein(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def anls(pred, answers, tau=0.5):
    best = 0.0
    for a in answers:
        p, g = pred.strip().lower(), a.strip().lower()
        nl = levenshtein(p, g) / max(len(p), len(g), 1)
        best = max(best, 1 - nl if nl < tau else 0.0)
    return best


class DocVQA(Dataset):
    def __init__(self, path, processor, max_len):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.proc = processor
        self.max_len = max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        image = Image.open(r["image"]).convert("RGB")
        enc = self.proc(image, r["question"], r["words"], boxes=r["boxes"], truncation="only_second",
                        max_length=self.max_len, padding="max_length", return_tensors="pt")
        word_ids = enc.word_ids(0)
        seq_ids = enc.sequence_ids(0)
        start = end = 0
        if r.get("start_word") is not None:
            for t, (w, s) in enumerate(zip(word_ids, seq_ids)):
                if s != 1:
                    continue
                if w == r["start_word"] and start == 0:
                    start = t
                if w == r["end_word"]:
                    end = t
            if end < start:
                start = end = 0
        item = {k: v[0] for k, v in enc.items()}
        item["start_positions"] = torch.tensor(start)
        item["end_positions"] = torch.tensor(end)
        item["idx"] = torch.tensor(i)
        return item


def decode_answer(tokenizer, input_ids, s_logits, e_logits, max_ans=32):
    s_top = s_logits.topk(10).indices.tolist()
    e_top = e_logits.topk(10).indices.tolist()
    best, span = -1e9, (0, 0)
    for s in s_top:
        for e in e_top:
            if s <= e < s + max_ans and (s_logits[s] + e_logits[e]) > best:
                best, span = s_logits[s] + e_logits[e], (s, e)
    return tokenizer.decode(input_ids[span[0]: span[1] + 1], skip_special_tokens=True)


@torch.no_grad()
def evaluate(model, loader, dataset, tokenizer, device):
    model.eval()
    score = torch.zeros(2, device=device)
    for batch in loader:
        idx = batch.pop("idx")
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        for b in range(idx.size(0)):
            pred = decode_answer(tokenizer, batch["input_ids"][b], out.start_logits[b].float(), out.end_logits[b].float())
            score[0] += anls(pred, dataset.rows[idx[b].item()]["answers"])
            score[1] += 1
    dist.all_reduce(score)
    model.train()
    return (score[0] / score[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    processor = LayoutLMv3Processor.from_pretrained(args.model, apply_ocr=False)
    train_ds = DocVQA(args.train, processor, args.max_len)
    val_ds = DocVQA(args.val, processor, args.max_len)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=args.workers,
                          pin_memory=True, drop_last=True)
    # eval batches go through FSDP forwards (collectives), so every rank needs the same count
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, sampler=val_sampler, num_workers=args.workers)

    model = LayoutLMv3ForQuestionAnswering.from_pretrained(args.model)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LayoutLMv3Layer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        device_id=torch.cuda.current_device(),
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(0.05 * total), total)

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            batch.pop("idx")
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                print(f"epoch {epoch} step {step}/{len(train_dl)} loss {loss.item():.4f}", flush=True)

        val_anls = evaluate(model, val_dl, val_ds, processor.tokenizer, device)
        if rank == 0:
            print(f"epoch {epoch}: val ANLS {val_anls:.4f}", flush=True)
        if val_anls > best:
            best = val_anls
            if rank == 0:
                cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
                    state = model.state_dict()
                os.makedirs(args.out, exist_ok=True)
                torch.save(state, os.path.join(args.out, "pytorch_model.bin"))
                processor.save_pretrained(args.out)
                print(f"saved new best ({best:.4f}) to {args.out}", flush=True)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
