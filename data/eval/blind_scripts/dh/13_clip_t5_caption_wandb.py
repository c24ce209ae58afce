"""CLIP ViT-L/14 features -> T5 encoder-decoder captioner (COCO Karpathy).

The CLIP tower is frozen; patch features go through a small mapper and are fed
to T5 as encoder inputs_embeds.

    torchrun --nproc_per_node=4 13_clip_t5_caption_wandb.py --run_name clipL_t5base
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import wandb
from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, T5ForConditionalGeneration,
                          get_linear_schedule_with_warmup)
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.spice.spice import Spice
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--karpathy", default="/mnt/data/coco/dataset_coco.json")
    p.add_argument("--images", default="/mnt/data/coco")
    p.add_argument("--save_dir", default="/mnt/ckpt/clip_t5")
    p.add_argument("--run_name", default="clip_t5")
    p.add_argument("--clip", default="openai/clip-vit-large-patch14")
    p.add_argument("--t5", default="t5-base")
    p.add_argument("--batch_size", type=int, default=64, help="global")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--spice", action="store_true")
    return p.parse_args()


class Karpathy(Dataset):
    def __init__(self, path, root, split):
        ims = json.load(open(path))["images"]
        ims = [im for im in ims if im["split"] in (["train", "restval"] if split == "train" else [split])]
        self.root = root
        self.train = split == "train"
        self.samples = [(im, s["raw"]) for im in ims for s in im["sentences"]] if self.train else [(im, "") for im in ims]
        self.refs = {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in ims}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        im, cap = self.samples[i]
        return Image.open(os.path.join(self.root, im["filepath"], im["filename"])).convert("RGB"), cap, im["cocoid"]


class ClipT5(nn.Module):
    def __init__(self, clip_name, t5_name):
        super().__init__()
        self.clip = CLIPVisionModel.from_pretrained(clip_name)
        self.clip.requires_grad_(False)
        self.t5 = T5ForConditionalGeneration.from_pretrained(t5_name)
        d_clip, d_t5 = self.clip.config.hidden_size, self.t5.config.d_model
        self.mapper = nn.Sequential(nn.LayerNorm(d_clip), nn.Linear(d_clip, d_t5), nn.GELU(), nn.Linear(d_t5, d_t5))

    def image_embeds(self, pixel_values):
        with torch.no_grad():
            feats = self.clip(pixel_values=pixel_values).last_hidden_state
        return self.mapper(feats)

    def forward(self, pixel_values, labels, decoder_attention_mask):
        return self.t5(inputs_embeds=self.image_embeds(pixel_values), labels=labels,
                       decoder_attention_mask=decoder_attention_mask).loss

    @torch.no_grad()
    def caption(self, pixel_values, **gen_kwargs):
        return self.t5.generate(inputs_embeds=self.image_embeds(pixel_values), **gen_kwargs)


def coco_eval(preds, refs, use_spice=False):
    ptb = PTBTokenizer()
    gts = ptb.tokenize({k: [{"caption": c} for c in refs[k]] for k in preds})
    res = ptb.tokenize({k: [{"caption": v}] for k, v in preds.items()})
    out = {"BLEU-4": Bleu(4).compute_score(gts, res)[0][3], "CIDEr": Cider().compute_score(gts, res)[0]}
    if use_spice:
        out["SPICE"] = Spice().compute_score(gts, res)[0]
    return out


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="coco-captioning", name=args.run_name, config=vars(args))

    image_processor = CLIPImageProcessor.from_pretrained(args.clip)
    tokenizer = AutoTokenizer.from_pretrained(args.t5)
    train_set = Karpathy(args.karpathy, args.images, "train")
    val_set = Karpathy(args.karpathy, args.images, "val")

    def collate(batch):
        images, caps, ids = zip(*batch)
        pixel_values = image_processor(images=list(images), return_tensors="pt").pixel_values
        enc = tokenizer(list(caps), padding="longest", truncation=True, max_length=40, return_tensors="pt")
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        return pixel_values, labels, enc.attention_mask, torch.tensor(ids)

    sampler = DistributedSampler(train_set, shuffle=True)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler, num_workers=8,
                        collate_fn=collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=50, sampler=DistributedSampler(val_set, shuffle=False),
                            num_workers=8, collate_fn=collate)

    model = ClipT5(args.clip, args.t5).to(device)
    model = DDP(model, device_ids=[local_rank])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup, len(loader) * args.epochs)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        model.module.clip.eval()
        t0 = time.time()
        for pixel_values, labels, dec_mask, _ in loader:
            pixel_values, labels, dec_mask = pixel_values.to(device), labels.to(device), dec_mask.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(pixel_values, labels, dec_mask)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/lr": scheduler.get_last_lr()[0],
                               "train/sec_per_it": (time.time() - t0) / 50}, step=step)
                t0 = time.time()

        model.eval()
        local = {}
        for pixel_values, _, _, ids in val_loader:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model.module.caption(pixel_values.to(device), num_beams=args.num_beams,
                                           max_new_tokens=30, length_penalty=1.0)
            for i, c in zip(ids.tolist(), tokenizer.batch_decode(out, skip_special_tokens=True)):
                local[i] = c.strip()
        gathered = [None] * world
        dist.all_gather_object(gathered, local)
        if rank == 0:
            preds = {}
            for g in gathered:
                preds.update(g)
            scores = coco_eval(preds, val_set.refs, args.spice)
            print(f"epoch {epoch}: {scores}", flush=True)
            wandb.log({f"val/{k}": v for k, v in scores.items()} | {"epoch": epoch}, step=step)
            table = wandb.Table(columns=["image_id", "caption"], data=[[k, v] for k, v in list(preds.items())[:100]])
            wandb.log({"val/samples": table}, step=step)
            os.makedirs(args.save_dir, exist_ok=True)
            trainable = {k: v for k, v in model.module.state_dict().items() if not k.startswith("clip.")}
            torch.save({"model": trainable, "epoch": epoch, "scores": scores},
                       os.path.join(args.save_dir, f"{args.run_name}_last.pt"))
            if scores["CIDEr"] > best:
                best = scores["CIDEr"]
                torch.save({"model": trainable, "epoch": epoch, "scores": scores},
                           os.path.join(args.save_dir, f"{args.run_name}_best.pt"))
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
