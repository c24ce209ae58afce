"""Donut receipt parsing on CORD-v2 (image -> JSON), data parallel over all GPUs.

    torchrun --nproc_per_node=4 06_donut_cord_parsing.py --epochs 30 --out runs/donut_cord
"""
import argparse
import json
import os
import random
import re
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel

TASK_START = "<s_cord-v2>"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="naver-clova-ix/cord-v2")
    ap.add_argument("--pretrained", default="naver-clova-ix/donut-base")
    ap.add_argument("--out", default="runs/donut_cord")
    ap.add_argument("--height", type=int, default=1280)
    ap.add_argument("--width", type=int, default=960)
    ap.add_argument("--max_length", type=int, default=768)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--warmup_steps", type=int, default=300)
    ap.add_argument("--eval_every", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


def json2token(obj, new_tokens, sort_keys=True):
    if isinstance(obj, dict):
        if len(obj) == 1 and "text_sequence" in obj:
            return obj["text_sequence"]
        out = ""
        keys = sorted(obj.keys(), reverse=True) if sort_keys else obj.keys()
        for k in keys:
            new_tokens.update([f"<s_{k}>", f"</s_{k}>"])
            out += f"<s_{k}>" + json2token(obj[k], new_tokens, sort_keys) + f"</s_{k}>"
        return out
    if isinstance(obj, list):
        return "<sep/>".join(json2token(x, new_tokens, sort_keys) for x in obj)
    return str(obj)


def flatten_fields(parsed, prefix=""):
    """Turn the nested parse into a multiset of (path, value) pairs for field-level F1."""
    items = []
    if isinstance(parsed, dict):
        for k, v in parsed.items():
            items += flatten_fields(v, f"{prefix}{k}.")
    elif isinstance(parsed, list):
        for v in parsed:
            items += flatten_fields(v, prefix)
    else:
        items.append((prefix.rstrip("."), str(parsed).strip()))
    return items


class CordDataset(Dataset):
    def __init__(self, hf_split, processor, max_length, new_tokens, train):
        self.data = hf_split
        self.processor = processor
        self.max_length = max_length
        self.train = train
        self.targets = []
        for ex in hf_split:
            gt = json.loads(ex["ground_truth"])["gt_parse"]
            self.targets.append((json2token(gt, new_tokens) + processor.tokenizer.eos_token, gt))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        image = self.data[i]["image"].convert("RGB")
        pixel_values = self.processor(image, random_padding=self.train, return_tensors="pt").pixel_values[0]
        seq, gt = self.targets[i]
        ids = self.processor.tokenizer(
            TASK_START + seq, add_special_tokens=False, max_length=self.max_length,
            padding="max_length", truncation=True, return_tensors="pt",
        ).input_ids[0]
        labels = ids.clone()
        labels[labels == self.processor.tokenizer.pad_token_id] = -100
        labels[0] = -100  # task token is the prompt
        return {"pixel_values": pixel_values, "input_ids": ids, "labels": labels, "index": i}


@torch.no_grad()
def evaluate(model, loader, processor, dataset, device):
    model.eval()
    tok = processor.tokenizer
    counts = torch.zeros(3, device=device)  # tp, n_pred, n_gt
    start_id = tok.convert_tokens_to_ids(TASK_START)
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device)
        prompt = torch.full((pixel_values.size(0), 1), start_id, device=device)
        outputs = model.generate(
            pixel_values,
            decoder_input_ids=prompt,
            max_length=dataset.max_length,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            use_cache=True,
            bad_words_ids=[[tok.unk_token_id]],
        )
        for seq, idx in zip(tok.batch_decode(outputs), batch["index"].tolist()):
            seq = seq.replace(tok.eos_token, "").replace(tok.pad_token, "")
            seq = re.sub(r"<.*?>", "", seq, count=1).strip()
            pred = processor.token2json(seq)
            gt = dataset.targets[idx][1]
            pred_f, gt_f = flatten_fields(pred), flatten_fields(gt)
            remaining = list(gt_f)
            tp = 0
            for f in pred_f:
                if f in remaining:
                    remaining.remove(f)
                    tp += 1
            counts += torch.tensor([tp, len(pred_f), len(gt_f)], device=device, dtype=torch.float)
    dist.all_reduce(counts)
    model.train()
    tp, n_pred, n_gt = counts.tolist()
    precision = tp / max(n_pred, 1)
    recall = tp / max(n_gt, 1)
    return 2 * precision * recall / max(precision + recall, 1e-8)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)

    processor = DonutProcessor.from_pretrained(args.pretrained)
    processor.image_processor.size = {"height": args.height, "width": args.width}
    processor.image_processor.do_align_long_axis = False

    raw = load_dataset(args.dataset)
    new_tokens = set()
    train_ds = CordDataset(raw["train"], processor, args.max_length, new_tokens, train=True)
    val_ds = CordDataset(raw["validation"], processor, args.max_length, new_tokens, train=False)
    processor.tokenizer.add_special_tokens(
        {"additional_special_tokens": sorted(new_tokens) + [TASK_START, "<sep/>"]}
    )

    model = VisionEncoderDecoderModel.from_pretrained(args.pretrained)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.encoder.image_size = [args.height, args.width]
    model.config.decoder.max_length = args.max_length
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK_START)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=4, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / args.warmup_steps) * max(0.0, 1 - s / total_steps),
    )

    best_f1 = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for it, batch in enumerate(train_loader):
            pixel_values = batch["pixel_values"].to(device, non_blocking=True)
            input_ids = batch["input_ids"].to(device, non_blocking=True)
            labels = batch["labels"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=pixel_values, decoder_input_ids=input_ids[:, :-1],
                             labels=labels[:, 1:]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and it % 25 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
            f1 = evaluate(model, val_loader, processor, val_ds, device)
            if rank == 0:
                print(f"epoch {epoch} field F1 {f1:.4f}", flush=True)
                if f1 > best_f1:
                    best_f1 = f1
                    model.module.save_pretrained(args.out)
                    processor.save_pretrained(args.out)
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
