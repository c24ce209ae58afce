"""Flickr30k caption fine-tuning of BLIP-large with gradient accumulation and
beam-search CIDEr validation + early stopping.

    torchrun --nproc_per_node=4 06_blip_caption_flickr_accum.py --cfg cfg/flickr_blip_large.json
"""
import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BlipForConditionalGeneration, BlipProcessor

DEFAULTS = dict(
    model="Salesforce/blip-image-captioning-large",
    image_root="/data/flickr30k/images",
    train_ann="/data/flickr30k/ann/train.json",
    val_ann="/data/flickr30k/ann/val.json",
    out_dir="output/blip_flickr",
    micro_bs=8,
    accum=4,
    lr=2e-5,
    epochs=10,
    patience=2,
    num_beams=5,
    max_new_tokens=30,
)


class FlickrTrain(Dataset):
    def __init__(self, ann, root):
        self.samples = [(a["image"], c) for a in json.load(open(ann)) for c in a["captions"]]
        self.root = root

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, cap = self.samples[i]
        return Image.open(os.path.join(self.root, path)).convert("RGB"), cap


class FlickrVal(Dataset):
    def __init__(self, ann, root):
        self.anns = json.load(open(ann))
        self.root = root

    def __len__(self):
        return len(self.anns)

    def __getitem__(self, i):
        a = self.anns[i]
        return Image.open(os.path.join(self.root, a["image"])).convert("RGB"), i


def is_dist_main():
    return dist.get_rank() == 0


@torch.no_grad()
def validate(model, processor, loader, val_ds, cfg, device):
    model.eval()
    local = []
    for images, idx in loader:
        inputs = processor(images=images, return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ids = model.module.generate(pixel_values=inputs.pixel_values, num_beams=cfg["num_beams"],
                                        max_new_tokens=cfg["max_new_tokens"])
        for i, cap in zip(idx, processor.batch_decode(ids, skip_special_tokens=True)):
            local.append((int(i), cap))

    # collect predictions from all ranks; DistributedSampler padding repeats a
    # few indices, the dict below keeps one prediction per image
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)

    result = [None]
    if is_dist_main():
        preds = {}
        for part in gathered:
            for i, cap in part:
                preds[i] = cap
        tok = PTBTokenizer()
        gts = tok.tokenize({i: [{"caption": c} for c in val_ds.anns[i]["captions"]] for i in preds})
        res = tok.tokenize({i: [{"caption": preds[i]}] for i in preds})
        cider, _ = Cider().compute_score(gts, res)
        bleu, _ = Bleu(4).compute_score(gts, res)
        result = [{"CIDEr": cider, "BLEU-4": bleu[3], "n": len(preds)}]
    dist.broadcast_object_list(result, src=0)
    model.train()
    return result[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cfg", default=None)
    cli = parser.parse_args()
    cfg = dict(DEFAULTS)
    if cli.cfg:
        cfg.update(json.load(open(cli.cfg)))

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    device = torch.device("cuda", local_rank)
    world = dist.get_world_size()
    torch.manual_seed(1234)

    processor = BlipProcessor.from_pretrained(cfg["model"])
    model = BlipForConditionalGeneration.from_pretrained(cfg["model"]).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    def collate_train(batch):
        imgs, caps = zip(*batch)
        enc = processor(images=list(imgs), text=list(caps), padding=True, truncation=True,
                        max_length=40, return_tensors="pt")
        enc["labels"] = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return enc

    def collate_val(batch):
        imgs, idx = zip(*batch)
        return list(imgs), list(idx)

    train_ds = FlickrTrain(cfg["train_ann"], cfg["image_root"])
    val_ds = FlickrVal(cfg["val_ann"], cfg["image_root"])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=1234)
    train_loader = DataLoader(train_ds, batch_size=cfg["micro_bs"], sampler=train_sampler,
                              num_workers=8, pin_memory=True, collate_fn=collate_train, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=16, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=collate_val)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.05)
    updates_per_epoch = len(train_loader) // cfg["accum"]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg["lr"], pct_start=0.05,
                                                    total_steps=updates_per_epoch * cfg["epochs"])

    if is_dist_main():
        os.makedirs(cfg["out_dir"], exist_ok=True)
        print(f"{len(train_ds)} train pairs, effective batch {cfg['micro_bs'] * cfg['accum'] * world}")

    best, bad_epochs = -1.0, 0
    for epoch in range(cfg["epochs"]):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        loss_acc = torch.zeros((), device=device)
        n_updates = 0
        for i, batch in enumerate(train_loader):
            if i >= updates_per_epoch * cfg["accum"]:
                break
            batch = batch.to(device)
            last_micro = (i + 1) % cfg["accum"] == 0
            # skip the gradient all-reduce on all but the last micro-batch
            ctx = model.no_sync() if not last_micro else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(**batch).loss / cfg["accum"]
                loss.backward()
            loss_acc += loss.detach()
            if last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                n_updates += 1
                if n_updates % 50 == 0:
                    dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
                    if is_dist_main():
                        print(f"epoch {epoch} update {n_updates}/{updates_per_epoch} "
                              f"loss {loss_acc.item() / 50:.4f} ({time.time() - t0:.0f}s)", flush=True)
                    loss_acc.zero_()

        scores = validate(model, processor, val_loader, val_ds, cfg, device)
        if is_dist_main():
            print(f"epoch {epoch}: CIDEr {scores['CIDEr']:.4f} BLEU-4 {scores['BLEU-4']:.4f} on {scores['n']} images")
        if scores["CIDEr"] > best:
            best, bad_epochs = scores["CIDEr"], 0
            if is_dist_main():
                model.module.save_pretrained(os.path.join(cfg["out_dir"], "best"))
                processor.save_pretrained(os.path.join(cfg["out_dir"], "best"))
        else:
            bad_epochs += 1
        dist.barrier()
        # every rank got the same score from the broadcast, so they all stop together
        if bad_epochs >= cfg["patience"]:
            if is_dist_main():
                print(f"early stopping at epoch {epoch}, best CIDEr {best:.4f}")
            break

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
