"""Donut DocVQA fine-tuning (plain DDP), ANLS validation every epoch.

Questions are grouped per page in the source JSON; each (page, question) pair is one sample.

    torchrun --nproc_per_node=8 18_donut_docvqa_ddp_anls.py --train_json /data/docvqa/train_v1.0.json \
        --val_json /data/docvqa/val_v1.0.json --images /data/docvqa/documents --save_dir /ckpt/donut_docvqa
"""
import argparse
import json
import logging
import os
import re

import torch
import torch.distributed as dist
from PIL import Image
from rapidfuzz.distance import Levenshtein
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import DonutProcessor, VisionEncoderDecoderModel, get_linear_schedule_with_warmup

log = logging.getLogger("donut_docvqa")

TASK = "<s_docvqa>"
EXTRA = [TASK, "<s_question>", "</s_question>", "<s_answer>", "</s_answer>"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train_json", required=True)
    ap.add_argument("--val_json", required=True)
    ap.add_argument("--images", required=True)
    ap.add_argument("--save_dir", required=True)
    ap.add_argument("--pretrained", default="naver-clova-ix/donut-base")
    ap.add_argument("--height", type=int, default=2560)
    ap.add_argument("--width", type=int, default=1920)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--warmup_steps", type=int, default=1000)
    ap.add_argument("--val_limit", type=int, default=2000, help="questions used for per-epoch ANLS")
    return ap.parse_args()


class DocVQA(Dataset):
    def __init__(self, json_path, image_dir, processor, max_length, train, limit=None):
        with open(json_path) as fh:
            data = json.load(fh)["data"]
        self.rows = data[:limit] if limit else data
        self.image_dir = image_dir
        self.processor = processor
        self.max_length = max_length
        self.train = train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = Image.open(os.path.join(self.image_dir, os.path.basename(r["image"]))).convert("RGB")
        pixel_values = self.processor(img, random_padding=self.train, return_tensors="pt").pixel_values[0]
        prompt = f"{TASK}<s_question>{r['question']}</s_question><s_answer>"
        tok = self.processor.tokenizer
        if not self.train:
            prompt_ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids[0]
            return {"pixel_values": pixel_values, "prompt_ids": prompt_ids, "answers": r["answers"]}
        seq = prompt + r["answers"][0] + "</s_answer>" + tok.eos_token
        ids = tok(seq, add_special_tokens=False, max_length=self.max_length, padding="max_length",
                  truncation=True, return_tensors="pt").input_ids[0]
        labels = ids.clone()
        labels[labels == tok.pad_token_id] = -100
        n_prompt = len(tok(prompt, add_special_tokens=False).input_ids)
        labels[: n_prompt - 1] = -100
        return {"pixel_values": pixel_values, "labels": labels}


def anls(pred, answers, threshold=0.5):
    pred = pred.strip().lower()
    best = 0.0
    for a in answers:
        nl = Levenshtein.normalized_distance(pred, a.strip().lower())
        best = max(best, 1.0 - nl if nl < threshold else 0.0)
    return best


@torch.no_grad()
def validate(model, loader, processor, max_length, device):
    model.eval()
    tok = processor.tokenizer
    score_sum, count = 0.0, 0
    for batch in loader:
        out = model.generate(batch["pixel_values"].to(device), decoder_input_ids=batch["prompt_ids"].to(device),
                             max_length=max_length, early_stopping=True, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, use_cache=True, num_beams=1,
                             bad_words_ids=[[tok.unk_token_id]])
        text = tok.decode(out[0])
        m = re.search(r"<s_answer>(.*?)(?:</s_answer>|</s>|$)", text)
        pred = m.group(1).replace(tok.pad_token, "").strip() if m else ""
        score_sum += anls(pred, [a[0] for a in batch["answers"]])
        count += 1
    totals = torch.tensor([score_sum, count], dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train()
    return (totals[0] / max(totals[1], 1)).item(), int(totals[1])


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    processor = DonutProcessor.from_pretrained(args.pretrained)
    processor.image_processor.size = {"height": args.height, "width": args.width}
    processor.tokenizer.add_special_tokens({"additional_special_tokens": EXTRA})
    model = VisionEncoderDecoderModel.from_pretrained(args.pretrained)
    model.decoder.resize_token_embeddings(len(processor.tokenizer))
    model.config.encoder.image_size = [args.height, args.width]
    model.config.pad_token_id = processor.tokenizer.pad_token_id
    model.config.decoder_start_token_id = processor.tokenizer.convert_tokens_to_ids(TASK)
    model = DDP(model.to(device), device_ids=[local_rank])

    train_ds = DocVQA(args.train_json, args.images, processor, args.max_length, train=True)
    val_ds = DocVQA(args.val_json, args.images, processor, args.max_length, train=False, limit=args.val_limit)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=1, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total = args.epochs * len(train_dl)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, total)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, batch in enumerate(train_dl):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values=batch["pixel_values"].to(device, non_blocking=True),
                             labels=batch["labels"].to(device, non_blocking=True)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if rank == 0 and step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        score, n = validate(model.module, val_dl, processor, args.max_length, device)
        if rank == 0:
            log.info("epoch %d val ANLS %.4f over %d questions", epoch, score, n)
            if score > best:
                best = score
                model.module.save_pretrained(os.path.join(args.save_dir, "best"))
                processor.save_pretrained(os.path.join(args.save_dir, "best"))
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(args.save_dir, "last.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
