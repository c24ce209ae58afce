"""Fine-tune BLIP-VQA (ViT-B, 480px) on VQAv2 train + VG-QA and evaluate VQA accuracy on a
held-out slice of VQAv2 val (minival), keeping the best checkpoint.

    torchrun --nproc_per_node=8 09_blip_vqav2_finetune.py --train-ann /data/vqa/vqa_train.json \
        --vg-ann /data/vqa/vg_qa.json --val-ann /data/vqa/vqa_minival.json \
        --coco-root /data/coco/images --vg-root /data/visual_genome/images --out runs/blip_vqa
"""
import argparse
import collections
import json
import os
import re

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import BlipForQuestionAnswering, BlipProcessor

CONTRACTIONS = {"dont": "don't", "doesnt": "doesn't", "isnt": "isn't", "arent": "aren't", "cant": "can't",
                "wont": "won't", "im": "i'm", "ive": "i've", "whats": "what's", "thats": "that's"}
NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
           "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train-ann", required=True)
    p.add_argument("--vg-ann", default=None)
    p.add_argument("--val-ann", required=True)
    p.add_argument("--coco-root", required=True)
    p.add_argument("--vg-root", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="Salesforce/blip-vqa-base")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--wd", type=float, default=0.05)
    p.add_argument("--image-size", type=int, default=480)
    return p.parse_args()


def normalize_answer(a):
    a = a.lower().replace("\n", " ").replace("\t", " ").strip()
    a = re.sub(r"(?<=\d),(?=\d)", "", a)
    a = re.sub(r"[;/\[\]\"{}()=+\\_\-><@`,?!*#%^&$]", " ", a)
    a = re.sub(r"(?!<=\d)(\.)(?!\d)", "", a)
    words = []
    for w in a.split():
        w = NUMBERS.get(w, w)
        if w not in ("a", "an", "the"):
            words.append(CONTRACTIONS.get(w, w))
    return " ".join(words)


class VQADataset(Dataset):
    def __init__(self, ann_path, image_root, processor, image_size, train):
        self.ann = json.load(open(ann_path))
        self.root = image_root
        self.processor = processor
        self.train = train
        norm = transforms.Normalize(processor.image_processor.image_mean, processor.image_processor.image_std)
        aug = [transforms.RandomResizedCrop(image_size, scale=(0.5, 1.0),
                                            interpolation=transforms.InterpolationMode.BICUBIC),
               transforms.RandomHorizontalFlip()] if train else \
              [transforms.Resize((image_size, image_size), interpolation=transforms.InterpolationMode.BICUBIC)]
        self.tf = transforms.Compose(aug + [transforms.ToTensor(), norm])

    def __len__(self):
        return len(self.ann)

    def __getitem__(self, i):
        a = self.ann[i]
        img = self.tf(Image.open(os.path.join(self.root, a["image"])).convert("RGB"))
        if self.train:
            # most frequent answer as the generation target
            ans = collections.Counter(a["answer"]).most_common(1)[0][0]
            return img, a["question"], ans
        return img, a["question"], a["answer"]


def make_collate(processor, train):
    tok = processor.tokenizer

    def collate(batch):
        imgs = torch.stack([b[0] for b in batch])
        q = tok([b[1] for b in batch], padding="longest", truncation=True, max_length=35, return_tensors="pt")
        if not train:
            return imgs, q.input_ids, q.attention_mask, [b[2] for b in batch]
        a = tok([b[2] for b in batch], padding="longest", truncation=True, max_length=10, return_tensors="pt")
        labels = a.input_ids.masked_fill(a.attention_mask == 0, -100)
        return imgs, q.input_ids, q.attention_mask, labels
    return collate


@torch.no_grad()
def vqa_accuracy(model, loader, processor, device):
    model.eval()
    acc_sum, n = 0.0, 0
    for imgs, ids, att, gt_answers in loader:
        out = model.generate(pixel_values=imgs.to(device), input_ids=ids.to(device),
                             attention_mask=att.to(device), max_new_tokens=10, num_beams=1)
        preds = processor.batch_decode(out, skip_special_tokens=True)
        for p, gts in zip(preds, gt_answers):
            p = normalize_answer(p)
            gts = [normalize_answer(g) for g in gts]
            # official VQA metric: average over the 10 leave-one-out subsets of annotators
            accs = []
            for k in range(len(gts)):
                others = gts[:k] + gts[k + 1:]
                accs.append(min(1.0, sum(g == p for g in others) / 3.0))
            acc_sum += sum(accs) / len(accs)
            n += 1
    model.train()
    return 100.0 * acc_sum / max(n, 1)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    processor = BlipProcessor.from_pretrained(args.model)
    train_sets = [VQADataset(args.train_ann, args.coco_root, processor, args.image_size, train=True)]
    if args.vg_ann:
        train_sets.append(VQADataset(args.vg_ann, args.vg_root, processor, args.image_size, train=True))
    train_ds = ConcatDataset(train_sets)
    val_ds = VQADataset(args.val_ann, args.coco_root, processor, args.image_size, train=False)

    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                              pin_memory=True, drop_last=True, collate_fn=make_collate(processor, True))
    val_loader = DataLoader(val_ds, batch_size=64, sampler=DistributedSampler(val_ds, shuffle=False),
                            num_workers=4, collate_fn=make_collate(processor, False))

    model = BlipForQuestionAnswering.from_pretrained(args.model).to(device)
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(train_loader))

    os.makedirs(args.out, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        ddp.train()
        for it, (imgs, ids, att, labels) in enumerate(train_loader):
            imgs, ids, att, labels = imgs.to(device), ids.to(device), att.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(pixel_values=imgs, input_ids=ids, attention_mask=att, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            sched.step()
            if rank == 0 and it % 200 == 0:
                print(f"epoch {epoch} it {it}/{len(train_loader)} loss {loss.item():.4f}", flush=True)

        acc = vqa_accuracy(model, val_loader, processor, device)
        if rank == 0:
            print(f"epoch {epoch} minival VQA acc {acc:.2f} (best {best_acc:.2f})", flush=True)
            if acc > best_acc:
                best_acc = acc
                model.save_pretrained(os.path.join(args.out, "best"))
                processor.save_pretrained(os.path.join(args.out, "best"))
            with open(os.path.join(args.out, "log.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "vqa_acc": acc}) + "\n")
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
