"""
Swin-B encoder + GPT-2 (cross-attention) decoder for MIMIC-CXR findings generation.
Gradient accumulation, activation checkpointing in the decoder, greedy decoding for val.

    torchrun --nproc_per_node=4 09_swin_gpt2_reportgen_accum.py --train-csv splits/train.csv \
        --val-csv splits/val.csv --image-root /data/mimic-cxr-jpg/files --out runs/swin_gpt2
"""
import argparse
import contextlib
import json
import os
import time

import pandas as pd
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from nltk.translate.bleu_score import corpus_bleu
from PIL import Image
from rouge_score import rouge_scorer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms as T
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup


class FindingsDataset(Dataset):
    def __init__(self, csv, image_root, tok, max_len, train):
        df = pd.read_csv(csv)
        self.paths, self.texts = df["image_path"].tolist(), df["findings"].astype(str).tolist()
        self.root, self.tok, self.max_len = image_root, tok, max_len
        norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        self.tf = T.Compose(([T.RandomResizedCrop(224, scale=(0.85, 1.0))] if train else
                             [T.Resize(224), T.CenterCrop(224)]) + [T.ToTensor(), norm])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = self.tf(Image.open(os.path.join(self.root, self.paths[i])).convert("RGB"))
        enc = self.tok(self.tok.bos_token + self.texts[i] + self.tok.eos_token, max_length=self.max_len,
                       truncation=True, padding="max_length", return_tensors="pt")
        return img, enc.input_ids[0], enc.attention_mask[0], i


class SwinGPT2(nn.Module):
    def __init__(self, swin="swin_base_patch4_window7_224.ms_in22k", gpt2="gpt2-medium"):
        super().__init__()
        self.encoder = timm.create_model(swin, pretrained=True, num_classes=0, global_pool="")
        cfg = GPT2Config.from_pretrained(gpt2, add_cross_attention=True)
        self.decoder = GPT2LMHeadModel.from_pretrained(gpt2, config=cfg)
        self.decoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.bridge = nn.Linear(self.encoder.num_features, cfg.n_embd)

    def visual_tokens(self, images):
        f = self.encoder.forward_features(images)        # B x 7 x 7 x C (NHWC in timm swin)
        return self.bridge(f.flatten(1, 2))

    def forward(self, images, ids, mask):
        labels = ids.masked_fill(mask == 0, -100)
        return self.decoder(input_ids=ids, attention_mask=mask, encoder_hidden_states=self.visual_tokens(images),
                            labels=labels, use_cache=False).loss

    @torch.no_grad()
    def generate(self, images, bos_id, eos_id, max_new=120):
        mem = self.visual_tokens(images)
        seq = torch.full((images.size(0), 1), bos_id, device=images.device, dtype=torch.long)
        past, finished = None, torch.zeros(images.size(0), dtype=torch.bool, device=images.device)
        for _ in range(max_new):
            out = self.decoder(input_ids=seq[:, -1:], encoder_hidden_states=mem, past_key_values=past,
                               use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1).masked_fill(finished, eos_id)
            seq = torch.cat([seq, nxt[:, None]], 1)
            finished |= nxt == eos_id
            if finished.all():
                break
        return seq[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-csv", required=True)
    ap.add_argument("--val-csv", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--out", default="runs/swin_gpt2")
    ap.add_argument("--micro-bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-len", type=int, default=160)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained("gpt2-medium")
    tok.pad_token = tok.eos_token
    train_ds = FindingsDataset(args.train_csv, args.image_root, tok, args.max_len, True)
    val_ds = FindingsDataset(args.val_csv, args.image_root, tok, args.max_len, False)
    tr_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    va_sampler = DistributedSampler(val_ds, shuffle=False)
    tr_dl = DataLoader(train_ds, args.micro_bs, sampler=tr_sampler, num_workers=8, pin_memory=True, drop_last=True)
    va_dl = DataLoader(val_ds, 32, sampler=va_sampler, num_workers=8, pin_memory=True)

    model = DDP(SwinGPT2().to(dev), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    updates_per_epoch = len(tr_dl) // args.accum
    sched = get_linear_schedule_with_warmup(opt, 1000, args.epochs * updates_per_epoch)
    scorer = rouge_scorer.RougeScorer(["rougeL"])

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"global batch = {args.micro_bs} x {args.accum} x {world} = {args.micro_bs * args.accum * world}")

    best = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        opt.zero_grad(set_to_none=True)
        for step, (img, ids, mask, _) in enumerate(tr_dl):
            img, ids, mask = img.to(dev, non_blocking=True), ids.to(dev), mask.to(dev)
            boundary = (step + 1) % args.accum == 0
            # skip the gradient all-reduce on the intermediate micro-batches
            ctx = contextlib.nullcontext() if boundary else model.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(img, ids, mask) / args.accum
                loss.backward()
            if boundary:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if rank == 0 and (step // args.accum) % 100 == 0:
                    print(f"ep {epoch} upd {step // args.accum}/{updates_per_epoch} "
                          f"loss {loss.item() * args.accum:.3f} {time.time() - t0:.0f}s", flush=True)

        model.eval()
        mine = []
        for img, ids, mask, idx in va_dl:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                gen = model.module.generate(img.to(dev), tok.bos_token_id, tok.eos_token_id)
            preds = tok.batch_decode(gen, skip_special_tokens=True)
            refs = tok.batch_decode(ids, skip_special_tokens=True)
            mine += [(int(i), p.strip(), r.strip()) for i, p, r in zip(idx, preds, refs)]
        everything = [None for _ in range(world)]
        dist.all_gather_object(everything, mine)

        if rank == 0:
            by_id = {i: (p, r) for part in everything for i, p, r in part}
            order = sorted(by_id)
            bleu = corpus_bleu([[by_id[i][1].split()] for i in order], [by_id[i][0].split() for i in order])
            rl = sum(scorer.score(by_id[i][1], by_id[i][0])["rougeL"].fmeasure for i in order) / len(order)
            print(f"epoch {epoch}: BLEU-4 {bleu:.4f} ROUGE-L {rl:.4f} on {len(order)} studies", flush=True)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(args.out, "last.pt"))
            if bleu > best:
                best = bleu
                torch.save(model.module.state_dict(), os.path.join(args.out, "best_bleu.pt"))
                with open(os.path.join(args.out, "val_generations.jsonl"), "w") as f:
                    for i in order:
                        f.write(json.dumps({"idx": i, "pred": by_id[i][0], "ref": by_id[i][1]}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
