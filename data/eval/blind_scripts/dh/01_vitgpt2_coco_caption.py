"""ViT encoder + GPT-2 decoder captioning on COCO (Karpathy split).

Launch with torchrun, one process per GPU.
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from PIL import Image

import timm
from transformers import GPT2LMHeadModel, GPT2TokenizerFast, get_cosine_schedule_with_warmup
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--karpathy_json", default="data/coco/dataset_coco.json")
    p.add_argument("--image_root", default="data/coco/images")
    p.add_argument("--output_dir", default="runs/vitgpt2")
    p.add_argument("--vit", default="vit_base_patch16_224.augreg_in21k")
    p.add_argument("--gpt2", default="gpt2")
    p.add_argument("--global_batch_size", type=int, default=256)
    p.add_argument("--eval_batch_size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup_ratio", type=float, default=0.05)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--max_len", type=int, default=32)
    p.add_argument("--gen_max_len", type=int, default=30)
    p.add_argument("--num_workers", type=int, default=8)
    return p.parse_args()


class CocoKarpathy(Dataset):
    def __init__(self, karpathy_json, image_root, split, transform, tokenizer=None, max_len=32):
        with open(karpathy_json) as f:
            images = json.load(f)["images"]
        keep = ("train", "restval") if split == "train" else (split,)
        images = [im for im in images if im["split"] in keep]
        self.image_root = image_root
        self.transform = transform
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.train = split == "train"
        if self.train:
            self.items = [(im["filepath"], im["filename"], im["cocoid"], s["raw"].strip())
                          for im in images for s in im["sentences"]]
        else:
            self.items = [(im["filepath"], im["filename"], im["cocoid"], [s["raw"].strip() for s in im["sentences"]])
                          for im in images]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        folder, fname, cocoid, text = self.items[idx]
        img = Image.open(os.path.join(self.image_root, folder, fname)).convert("RGB")
        sample = {"pixel_values": self.transform(img), "image_id": cocoid}
        if self.train:
            enc = self.tokenizer(self.tokenizer.bos_token + text + self.tokenizer.eos_token,
                                 max_length=self.max_len, truncation=True, padding="max_length",
                                 return_tensors="pt")
            ids = enc.input_ids[0]
            mask = enc.attention_mask[0]
            labels = ids.clone()
            labels[mask == 0] = -100
            sample.update(input_ids=ids, attention_mask=mask, labels=labels)
        return sample


class Captioner(nn.Module):
    def __init__(self, vit_name, gpt2_name):
        super().__init__()
        self.encoder = timm.create_model(vit_name, pretrained=True, num_classes=0)
        self.decoder = GPT2LMHeadModel.from_pretrained(gpt2_name, add_cross_attention=True)
        self.proj = nn.Linear(self.encoder.num_features, self.decoder.config.n_embd)

    def encode(self, pixel_values):
        return self.proj(self.encoder.forward_features(pixel_values))

    def forward(self, pixel_values, input_ids, attention_mask, labels):
        enc = self.encode(pixel_values)
        return self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                            encoder_hidden_states=enc, labels=labels).loss

    @torch.no_grad()
    def greedy(self, pixel_values, bos_id, eos_id, max_len):
        enc = self.encode(pixel_values)
        B = enc.size(0)
        ids = torch.full((B, 1), bos_id, dtype=torch.long, device=enc.device)
        done = torch.zeros(B, dtype=torch.bool, device=enc.device)
        past = None
        for _ in range(max_len):
            out = self.decoder(input_ids=ids[:, -1:], past_key_values=past,
                               encoder_hidden_states=enc, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            done |= nxt == eos_id
            if done.all():
                break
        return ids[:, 1:]


def caption_metrics(preds, gts):
    tok = PTBTokenizer()
    res = tok.tokenize({k: [{"caption": v}] for k, v in preds.items()})
    ref = tok.tokenize({k: [{"caption": c} for c in gts[k]] for k in preds})
    bleu, _ = Bleu(4).compute_score(ref, res)
    cider, _ = Cider().compute_score(ref, res)
    return {"BLEU-1": bleu[0], "BLEU-4": bleu[3], "CIDEr": cider}


@torch.no_grad()
def evaluate(model, loader, dataset, tokenizer, args, device, world_size):
    model.eval()
    net = model.module
    tokens, image_ids = [], []
    for batch in loader:
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net.greedy(pixel_values, tokenizer.bos_token_id, tokenizer.eos_token_id, args.gen_max_len)
        tokens.extend(out.unbind(0))
        image_ids.append(batch["image_id"].to(device))
    tokens = pad_sequence(tokens, batch_first=True, padding_value=tokenizer.eos_token_id)
    image_ids = torch.cat(image_ids)

    gathered_tokens = [torch.zeros_like(tokens) for _ in range(world_size)]
    gathered_ids = [torch.zeros_like(image_ids) for _ in range(world_size)]
    dist.all_gather(gathered_tokens, tokens)
    dist.all_gather(gathered_ids, image_ids)
    model.train()

    if dist.get_rank() != 0:
        return None
    preds = {}
    for toks, ids in zip(gathered_tokens, gathered_ids):
        for t, i in zip(toks.tolist(), ids.tolist()):
            # DistributedSampler pads the last batch with repeats; keep the first copy
            if i not in preds:
                preds[i] = tokenizer.decode(t, skip_special_tokens=True).strip()
    gts = {im_id: caps for _, _, im_id, caps in dataset.items}
    return caption_metrics(preds, gts)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234)
    torch.backends.cuda.matmul.allow_tf32 = True

    tokenizer = GPT2TokenizerFast.from_pretrained(args.gpt2)
    tokenizer.pad_token = tokenizer.eos_token

    norm = transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    train_tf = transforms.Compose([transforms.RandomResizedCrop(224, scale=(0.5, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
    eval_tf = transforms.Compose([transforms.Resize((224, 224)), transforms.ToTensor(), norm])
    train_set = CocoKarpathy(args.karpathy_json, args.image_root, "train", train_tf, tokenizer, args.max_len)
    val_set = CocoKarpathy(args.karpathy_json, args.image_root, "val", eval_tf)

    per_gpu_bs = args.global_batch_size // world_size
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=1234, drop_last=True)
    val_sampler = DistributedSampler(val_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=per_gpu_bs, sampler=train_sampler,
                              num_workers=args.num_workers, pin_memory=True, drop_last=True,
                              persistent_workers=True)
    val_loader = DataLoader(val_set, batch_size=args.eval_batch_size, sampler=val_sampler,
                            num_workers=args.num_workers, pin_memory=True)

    model = Captioner(args.vit, args.gpt2).to(device)
    model = DDP(model, device_ids=[local_rank])

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "ln" in n or "norm" in n else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(args.warmup_ratio * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"world={world_size} per_gpu_bs={per_gpu_bs} steps={total_steps}", flush=True)

    best_cider = 0.0
    step = 0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "image_id"}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 100 == 0:
                log_loss = loss.detach().clone()
                dist.all_reduce(log_loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total_steps} loss {log_loss.item():.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.2e} {time.time() - t0:.0f}s", flush=True)

        metrics = evaluate(model, val_loader, val_set, tokenizer, args, device, world_size)
        if rank == 0:
            print(f"epoch {epoch} val {json.dumps(metrics)}", flush=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "metrics": metrics}
            torch.save(state, os.path.join(args.output_dir, "last.pt"))
            if metrics["CIDEr"] > best_cider:
                best_cider = metrics["CIDEr"]
                torch.save(model.module.state_dict(), os.path.join(args.output_dir, "best_model.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
