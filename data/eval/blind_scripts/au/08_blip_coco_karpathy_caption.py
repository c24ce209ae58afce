"""Fine-tune BLIP (ViT-B) captioning on the COCO Karpathy split, evaluate CIDEr / BLEU-4.

Caption annotations are normalised and tokenised once and cached next to the annotation file.

    torchrun --nproc_per_node=8 08_blip_coco_karpathy_caption.py --ann-dir /data/coco/karpathy \
        --image-root /data/coco/images --out runs/blip_base_coco_cap
"""
import argparse
import json
import os
import re

import torch
import torch.distributed as dist
from PIL import Image
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import BlipForConditionalGeneration, BlipProcessor


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ann-dir", required=True)
    p.add_argument("--image-root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="Salesforce/blip-image-captioning-base")
    p.add_argument("--prompt", default="a picture of ")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--max-len", type=int, default=40)
    p.add_argument("--num-beams", type=int, default=3)
    return p.parse_args()


def pre_caption(caption, max_words=30):
    caption = re.sub(r"([.!\"()*#:;~])", " ", caption.lower())
    caption = re.sub(r"\s{2,}", " ", caption).rstrip("\n").strip(" ")
    return " ".join(caption.split(" ")[:max_words])


def load_or_build_cache(ann_dir, split, tokenizer, prompt, max_len):
    cache = os.path.join(ann_dir, f"coco_karpathy_{split}.tok.pt")
    if os.path.exists(cache):
        return torch.load(cache)
    ann = json.load(open(os.path.join(ann_dir, f"coco_karpathy_{split}.json")))
    records = []
    for a in ann:
        if split == "train":
            cap = prompt + pre_caption(a["caption"])
            ids = tokenizer(cap, max_length=max_len, truncation=True, padding="max_length").input_ids
            records.append({"image": a["image"], "input_ids": torch.tensor(ids, dtype=torch.int32)})
        else:
            records.append({"image": a["image"], "image_id": int(a["image"].split("_")[-1][:-4]),
                            "refs": a["caption"]})
    torch.save(records, cache)
    return records


class CocoCaption(Dataset):
    def __init__(self, records, image_root, train):
        self.records = records
        self.root = image_root
        norm = transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
        if train:
            self.tf = transforms.Compose([
                transforms.RandomResizedCrop(384, scale=(0.5, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.RandomHorizontalFlip(), transforms.ToTensor(), norm])
        else:
            self.tf = transforms.Compose([
                transforms.Resize((384, 384), interpolation=transforms.InterpolationMode.BICUBIC),
                transforms.ToTensor(), norm])
        self.train = train

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        img = self.tf(Image.open(os.path.join(self.root, r["image"])).convert("RGB"))
        if self.train:
            return img, r["input_ids"].long()
        return img, r["image_id"]


@torch.no_grad()
def evaluate(model, loader, processor, refs, args, device):
    model.eval()
    preds = []
    prompt_ids = processor.tokenizer(args.prompt, return_tensors="pt").input_ids[:, :-1].to(device)
    for images, image_ids in loader:
        images = images.to(device)
        out = model.generate(pixel_values=images, input_ids=prompt_ids.expand(images.size(0), -1),
                             num_beams=args.num_beams, max_length=args.max_len, min_length=5)
        caps = processor.batch_decode(out, skip_special_tokens=True)
        preds += [{"image_id": int(i), "caption": c[len(args.prompt):].strip()} for i, c in zip(image_ids, caps)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, preds)
    model.train()
    if dist.get_rank() != 0:
        return None
    res = {}
    for part in gathered:
        for p in part:
            res[p["image_id"]] = [{"caption": p["caption"]}]   # dedups the sampler's padding
    gts = {k: [{"caption": c} for c in refs[k]] for k in res}
    tok = PTBTokenizer()
    gts, res = tok.tokenize(gts), tok.tokenize(res)
    cider, _ = Cider().compute_score(gts, res)
    bleu, _ = Bleu(4).compute_score(gts, res)
    return {"CIDEr": cider, "BLEU-4": bleu[3]}


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    processor = BlipProcessor.from_pretrained(args.model)
    train_records = load_or_build_cache(args.ann_dir, "train", processor.tokenizer, args.prompt, args.max_len)
    val_records = load_or_build_cache(args.ann_dir, "val", processor.tokenizer, args.prompt, args.max_len)
    refs = {r["image_id"]: r["refs"] for r in val_records}

    train_ds = CocoCaption(train_records, args.image_root, train=True)
    val_ds = CocoCaption(val_records, args.image_root, train=False)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4)

    model = BlipForConditionalGeneration.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader), eta_min=0)
    pad_id = processor.tokenizer.pad_token_id
    n_prompt = len(processor.tokenizer(args.prompt).input_ids) - 1

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for it, (images, ids) in enumerate(train_loader):
            images, ids = images.to(device, non_blocking=True), ids.to(device, non_blocking=True)
            labels = ids.masked_fill(ids == pad_id, -100)
            labels[:, :n_prompt] = -100
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(pixel_values=images, input_ids=ids, attention_mask=(ids != pad_id).long(),
                           labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        metrics = evaluate(model, val_loader, processor, refs, args, device)
        if rank == 0:
            print(f"epoch {epoch} {metrics}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            if metrics["CIDEr"] > best:
                best = metrics["CIDEr"]
                model.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
