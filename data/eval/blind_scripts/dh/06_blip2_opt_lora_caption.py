"""LoRA fine-tuning of BLIP-2 (OPT-2.7B) for COCO captioning.

Vision encoder and Q-Former stay frozen, LoRA adapters on the OPT attention.
    torchrun --nproc_per_node=8 06_blip2_opt_lora_caption.py --config configs/blip2_coco.yaml
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import yaml
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from peft import LoraConfig, get_peft_model
from transformers import Blip2ForConditionalGeneration, Blip2Processor, get_linear_schedule_with_warmup
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.meteor.meteor import Meteor

DEFAULTS = {
    "model": "Salesforce/blip2-opt-2.7b",
    "karpathy_json": "/datasets/coco/dataset_coco.json",
    "image_root": "/datasets/coco",
    "output_dir": "outputs/blip2_lora",
    "global_batch_size": 128,
    "eval_batch_size": 32,
    "epochs": 5,
    "lr": 1e-4,
    "warmup_steps": 500,
    "lora_r": 16,
    "lora_alpha": 32,
    "prompt": "a photo of",
    "num_beams": 5,
    "max_new_tokens": 30,
}


class KarpathyCoco(Dataset):
    def __init__(self, path, image_root, split):
        with open(path) as f:
            imgs = json.load(f)["images"]
        splits = {"train", "restval"} if split == "train" else {split}
        imgs = [im for im in imgs if im["split"] in splits]
        self.image_root = image_root
        self.train = split == "train"
        if self.train:
            self.items = [(im, s["raw"].strip()) for im in imgs for s in im["sentences"]]
        else:
            self.items = [(im, None) for im in imgs]
        self.refs = {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in imgs}

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        im, cap = self.items[i]
        image = Image.open(os.path.join(self.image_root, im["filepath"], im["filename"])).convert("RGB")
        return image, cap, im["cocoid"]


def evaluate_captions(preds, refs):
    tok = PTBTokenizer()
    gts = tok.tokenize({k: [{"caption": c} for c in refs[k]] for k in preds})
    res = tok.tokenize({k: [{"caption": v}] for k, v in preds.items()})
    out = {}
    bleu, _ = Bleu(4).compute_score(gts, res)
    out.update({f"Bleu_{i + 1}": b for i, b in enumerate(bleu)})
    out["METEOR"], _ = Meteor().compute_score(gts, res)
    out["CIDEr"], _ = Cider().compute_score(gts, res)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = dict(DEFAULTS)
    if cli.config:
        with open(cli.config) as f:
            cfg.update(yaml.safe_load(f) or {})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(0)
    torch.manual_seed(0)

    processor = Blip2Processor.from_pretrained(cfg["model"])
    tokenizer = processor.tokenizer
    model = Blip2ForConditionalGeneration.from_pretrained(
        cfg["model"], torch_dtype=torch.bfloat16, device_map="auto")
    lora_cfg = LoraConfig(r=cfg["lora_r"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.05,
                          target_modules=["q_proj", "v_proj"], bias="none")
    model = get_peft_model(model, lora_cfg)
    if rank == 0:
        model.print_trainable_parameters()
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # keep the adapters in fp32
    model = DDP(model, device_ids=[local_rank])

    train_set = KarpathyCoco(cfg["karpathy_json"], cfg["image_root"], "train")
    val_set = KarpathyCoco(cfg["karpathy_json"], cfg["image_root"], "val")
    prompt = cfg["prompt"]

    def train_collate(batch):
        images, caps, _ = zip(*batch)
        enc = processor(images=list(images), text=[f"{prompt} {c}" for c in caps], padding="longest",
                        truncation=True, max_length=48, return_tensors="pt")
        labels = enc.input_ids.clone()
        labels[enc.attention_mask == 0] = -100
        n_prompt = len(tokenizer(prompt, add_special_tokens=True).input_ids)
        labels[:, :n_prompt] = -100
        enc["labels"] = labels
        return enc

    def eval_collate(batch):
        images, _, ids = zip(*batch)
        enc = processor(images=list(images), text=[prompt] * len(images), return_tensors="pt")
        return enc, list(ids)

    per_gpu = cfg["global_batch_size"] // world_size
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=per_gpu, sampler=train_sampler, num_workers=8,
                              collate_fn=train_collate, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_set, batch_size=cfg["eval_batch_size"], num_workers=8,
                            sampler=DistributedSampler(val_set, shuffle=False), collate_fn=eval_collate)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=0.05)
    total = len(train_loader) * cfg["epochs"]
    scheduler = get_linear_schedule_with_warmup(optimizer, cfg["warmup_steps"], total)

    step = 0
    best = 0.0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        tic = time.time()
        for batch in train_loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"{(time.time() - tic) / 50:.2f}s/it", flush=True)
                    tic = time.time()

        model.eval()
        local = {}
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for enc, ids in val_loader:
                enc = enc.to(device)
                out = model.module.generate(pixel_values=enc.pixel_values.to(torch.bfloat16),
                                            input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                                            num_beams=cfg["num_beams"], max_new_tokens=cfg["max_new_tokens"],
                                            min_length=5)
                for i, text in zip(ids, tokenizer.batch_decode(out, skip_special_tokens=True)):
                    local[i] = text.replace(prompt, "", 1).strip() if text.startswith(prompt) else text.strip()
        parts = [None] * world_size
        dist.all_gather_object(parts, local)

        if rank == 0:
            preds = {}
            for part in parts:
                preds.update(part)
            scores = evaluate_captions(preds, val_set.refs)
            print(f"epoch {epoch} val ({len(preds)} images): {json.dumps(scores)}", flush=True)
            os.makedirs(cfg["output_dir"], exist_ok=True)
            model.module.save_pretrained(os.path.join(cfg["output_dir"], f"epoch{epoch}"))
            if scores["CIDEr"] > best:
                best = scores["CIDEr"]
                model.module.save_pretrained(os.path.join(cfg["output_dir"], "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
