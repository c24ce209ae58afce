"""Indication-conditioned report generation: ViT-S/16 (384px) patch tokens are
projected into Flan-T5's encoder together with the clinical indication text.

torchrun --nproc_per_node=4 12_vit_flant5_prompted.py --train data/mimic_ind/train.jsonl \
    --val data/mimic_ind/val.jsonl --epochs 30
"""
import argparse
import json
import os
import time

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.rouge import Rouge
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import AutoTokenizer, T5ForConditionalGeneration, get_linear_schedule_with_warmup


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--val", required=True)
    p.add_argument("--image-root", default="/data/mimic-cxr-jpg")
    p.add_argument("--t5", default="google/flan-t5-base")
    p.add_argument("--out", default="runs/vit_flant5")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-src", type=int, default=64)
    p.add_argument("--max-tgt", type=int, default=160)
    p.add_argument("--beams", type=int, default=3)
    return p.parse_args()


class IndicationReports(Dataset):
    def __init__(self, path, root, train):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.root = root
        self.tf = transforms.Compose([
            transforms.Resize(400),
            transforms.RandomCrop(384) if train else transforms.CenterCrop(384),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.tf(Image.open(os.path.join(self.root, r["image"])).convert("RGB"))
        prompt = "Generate findings. Indication: " + (r.get("indication") or "none")
        return img, prompt, r["findings"], i


def make_collate(tok, max_src, max_tgt):
    def collate(batch):
        imgs, prompts, targets, idx = zip(*batch)
        src = tok(list(prompts), max_length=max_src, truncation=True, padding=True, return_tensors="pt")
        tgt = tok(list(targets), max_length=max_tgt, truncation=True, padding=True, return_tensors="pt")
        labels = tgt.input_ids.masked_fill(tgt.attention_mask == 0, -100)
        return torch.stack(imgs), src.input_ids, src.attention_mask, labels, list(targets), torch.tensor(idx)
    return collate


class ViTT5(nn.Module):
    def __init__(self, t5_name):
        super().__init__()
        self.vit = timm.create_model("vit_small_patch16_384.augreg_in21k_ft_in1k", pretrained=True,
                                     num_classes=0)
        self.t5 = T5ForConditionalGeneration.from_pretrained(t5_name)
        self.bridge = nn.Linear(self.vit.embed_dim, self.t5.config.d_model)

    def encoder_inputs(self, images, src_ids, src_mask):
        vis = self.bridge(self.vit.forward_features(images))
        txt = self.t5.get_input_embeddings()(src_ids)
        embeds = torch.cat([vis, txt], 1)
        mask = torch.cat([src_mask.new_ones(vis.shape[:2]), src_mask], 1)
        return embeds, mask

    def forward(self, images, src_ids, src_mask, labels):
        embeds, mask = self.encoder_inputs(images, src_ids, src_mask)
        return self.t5(inputs_embeds=embeds, attention_mask=mask, labels=labels).loss

    @torch.no_grad()
    def generate(self, images, src_ids, src_mask, **kw):
        embeds, mask = self.encoder_inputs(images, src_ids, src_mask)
        return self.t5.generate(inputs_embeds=embeds, attention_mask=mask, **kw)


def nlg_metrics(refs, hyps):
    gts = {i: [r] for i, r in enumerate(refs)}
    res = {i: [h if h else "."] for i, h in enumerate(hyps)}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    rouge, _ = Rouge().compute_score(gts, res)
    return {"bleu1": bleu[0], "bleu4": bleu[3], "rougeL": rouge}


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")

    tok = AutoTokenizer.from_pretrained(args.t5)
    collate = make_collate(tok, args.max_src, args.max_tgt)
    train_ds = IndicationReports(args.train, args.image_root, True)
    val_ds = IndicationReports(args.val, args.image_root, False)
    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_ds, shuffle=False),
                            collate_fn=collate, num_workers=8, pin_memory=True)

    model = DDP(ViTT5(args.t5).to(device), device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total_steps = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.04 * total_steps), total_steps)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} train / {len(val_ds)} val, {len(train_loader)} steps per epoch per rank")

    best_bleu = 0.0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        epoch_loss = torch.zeros(2, device=device)
        for step, (img, src, src_mask, labels, _, _) in enumerate(train_loader):
            img = img.to(device, non_blocking=True)
            src, src_mask, labels = src.to(device), src_mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(img, src, src_mask, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            epoch_loss += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if rank == 0 and step % 100 == 0:
                print(f"  ep {epoch} step {step} loss {loss.item():.4f}", flush=True)
        dist.all_reduce(epoch_loss)

        model.eval()
        local = []
        for img, src, src_mask, _, refs, idx in val_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.module.generate(img.to(device), src.to(device), src_mask.to(device),
                                            num_beams=args.beams, max_new_tokens=args.max_tgt)
            local += zip(idx.tolist(), tok.batch_decode(out, skip_special_tokens=True), refs)
        shards = [None] * world
        dist.all_gather_object(shards, local)

        if rank == 0:
            merged = {i: (h, r) for shard in shards for i, h, r in shard}
            hyps = [merged[i][0] for i in sorted(merged)]
            refs = [merged[i][1] for i in sorted(merged)]
            m = nlg_metrics(refs, hyps)
            print(f"epoch {epoch} loss {(epoch_loss[0] / epoch_loss[1]).item():.4f} "
                  f"bleu4 {m['bleu4']:.4f} rougeL {m['rougeL']:.4f} ({time.time() - t0:.0f}s)", flush=True)
            ck = {"model": model.module.state_dict(), "epoch": epoch, "metrics": m}
            torch.save(ck, os.path.join(args.out, "last.pt"))
            if m["bleu4"] > best_bleu:
                best_bleu = m["bleu4"]
                torch.save(ck, os.path.join(args.out, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
