"""BLIP VQA (generative answer decoder) fine-tuning on VQAv2 + VG QA, evaluated on
VQAv2 val with the standard 10-annotator soft accuracy.

    torchrun --nproc_per_node=8 20_blip_vqa_generative.py --train-files vqa_train.json vg_qa.json \
        --val-file vqa_val.json --image-root /data/images --output-dir output/blip_vqa
"""
import argparse
import json
import logging
import os
import re
import time
from collections import Counter

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import BlipForQuestionAnswering, BlipProcessor

logger = logging.getLogger(__name__)

_PUNCT = re.compile(r"[;/\[\]\"{}()=+\\_\-><@`,?!*#%^&$]")


def norm_answer(a):
    a = _PUNCT.sub("", a.lower().replace("\n", " ").replace("\t", " ")).strip()
    return re.sub(r"\b(a|an|the)\b", "", a).strip().rstrip(".")


class VQAJson(Dataset):
    def __init__(self, path, root, transform, train=True):
        self.rows = json.load(open(path))
        self.root, self.transform, self.train = root, transform, train

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.transform(Image.open(os.path.join(self.root, r["image"])).convert("RGB"))
        answers = r["answer"] if isinstance(r["answer"], list) else [r["answer"]]
        if self.train:
            # most frequent annotator answer as the target
            best = Counter(answers).most_common(1)[0][0]
            return img, r["question"], best
        return img, r["question"], answers


def build_transforms(size=480):
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    train = transforms.Compose([
        transforms.RandomResizedCrop(size, scale=(0.5, 1.0), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    test = transforms.Compose([
        transforms.Resize((size, size), interpolation=transforms.InterpolationMode.BICUBIC),
        transforms.ToTensor(), transforms.Normalize(mean, std)])
    return train, test


def vqa_soft_acc(pred, gts):
    pred = norm_answer(pred)
    return min(1.0, sum(norm_answer(g) == pred for g in gts) / 3.0)


@torch.no_grad()
def evaluate(model, processor, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    for images, questions, answers in loader:
        q = processor.tokenizer(list(questions), padding="longest", truncation=True, max_length=35,
                                return_tensors="pt").to(device)
        with torch.autocast("cuda", dtype=torch.float16):
            out = model.module.generate(pixel_values=images.to(device), input_ids=q.input_ids,
                                        attention_mask=q.attention_mask, num_beams=3, max_new_tokens=10)
        preds = processor.batch_decode(out, skip_special_tokens=True)
        tot[0] += sum(vqa_soft_acc(p, a) for p, a in zip(preds, answers))
        tot[1] += len(preds)
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-files", nargs="+", required=True)
    ap.add_argument("--val-file", required=True)
    ap.add_argument("--image-root", required=True)
    ap.add_argument("--output-dir", default="output/blip_vqa")
    ap.add_argument("--model", default="Salesforce/blip-vqa-base")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s - %(levelname)s - %(message)s")
    torch.manual_seed(args.seed + rank)

    processor = BlipProcessor.from_pretrained(args.model)
    model = BlipForQuestionAnswering.from_pretrained(args.model).to(device)
    model = DDP(model, device_ids=[local_rank])

    tf_train, tf_test = build_transforms()
    train_ds = ConcatDataset([VQAJson(f, args.image_root, tf_train, train=True) for f in args.train_files])
    val_ds = VQAJson(args.val_file, args.image_root, tf_test, train=False)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    val_sampler = DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False)

    def collate_train(batch):
        imgs, qs, ans = zip(*batch)
        return torch.stack(imgs), list(qs), list(ans)

    def collate_val(batch):
        imgs, qs, ans = zip(*batch)
        return torch.stack(imgs), list(qs), list(ans)

    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, collate_fn=collate_train)
    val_loader = DataLoader(val_ds, batch_size=64, sampler=val_sampler, num_workers=8, collate_fn=collate_val)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(train_loader), eta_min=0)
    scaler = torch.cuda.amp.GradScaler()
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
    logger.info("train %d qa pairs, val %d, %d GPUs", len(train_ds), len(val_ds), world)

    best = 0.0
    for epoch in range(args.epochs):
        model.train()
        start = time.time()
        for it, (images, questions, answers) in enumerate(train_loader):
            q = processor.tokenizer(questions, padding="longest", truncation=True, max_length=35, return_tensors="pt")
            a = processor.tokenizer(answers, padding="longest", truncation=True, max_length=10, return_tensors="pt")
            labels = a.input_ids.masked_fill(a.attention_mask == 0, -100)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(pixel_values=images.to(device, non_blocking=True), input_ids=q.input_ids.to(device),
                             attention_mask=q.attention_mask.to(device), labels=labels.to(device)).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if it % 200 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d [%d/%d] loss %.4f lr %.2e (%.0fs)", epoch, it, len(train_loader), l.item(),
                            scheduler.get_last_lr()[0], time.time() - start)

        acc = evaluate(model, processor, val_loader, device)
        logger.info("epoch %d val VQA acc %.2f", epoch, acc * 100)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "acc": acc},
                       os.path.join(args.output_dir, "checkpoint_last.pth"))
            if acc > best:
                best = acc
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    logger.info("best val acc %.2f", best * 100)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
