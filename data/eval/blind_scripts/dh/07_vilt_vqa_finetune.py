"""Fine-tune ViLT (dandelin/vilt-b32-mlm) on VQAv2 train, validate on val2014.

torchrun --standalone --nproc_per_node=8 07_vilt_vqa_finetune.py --vqa_root /data/vqa
"""
import argparse
import json
import logging
import os
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from transformers import ViltConfig, ViltForQuestionAnswering, ViltProcessor, get_linear_schedule_with_warmup

log = logging.getLogger(__name__)


def score_from_count(c):
    # official VQA soft score for an answer given by c of the 10 annotators
    return min(1.0, c / 3.0)


class VQAv2Dataset(Dataset):
    def __init__(self, root, split, label2id):
        qs = json.load(open(os.path.join(root, f"v2_OpenEnded_mscoco_{split}2014_questions.json")))["questions"]
        anns = json.load(open(os.path.join(root, f"v2_mscoco_{split}2014_annotations.json")))["annotations"]
        anns = {a["question_id"]: a for a in anns}
        self.items = []
        for q in qs:
            a = anns[q["question_id"]]
            counts = Counter(x["answer"] for x in a["answers"])
            labels = {label2id[ans]: score_from_count(c) for ans, c in counts.items() if ans in label2id}
            self.items.append({
                "qid": q["question_id"],
                "image": os.path.join(root, f"{split}2014", f"COCO_{split}2014_{q['image_id']:012d}.jpg"),
                "question": q["question"],
                "labels": labels,
                "answer_type": a["answer_type"],
                "question_type": a["question_type"],
            })
        self.num_labels = len(label2id)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        it = self.items[i]
        target = torch.zeros(self.num_labels)
        for k, v in it["labels"].items():
            target[k] = v
        return Image.open(it["image"]).convert("RGB"), it["question"], target, it["answer_type"], it["question_type"]


class Collator:
    def __init__(self, processor):
        self.processor = processor

    def __call__(self, batch):
        images, questions, targets, atypes, qtypes = zip(*batch)
        enc = self.processor(list(images), list(questions), padding="max_length", truncation=True,
                             max_length=40, return_tensors="pt")
        enc["labels"] = torch.stack(targets)
        return enc, list(atypes), list(qtypes)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    total, count = 0.0, 0
    by_atype = defaultdict(lambda: [0.0, 0])
    by_qtype = defaultdict(lambda: [0.0, 0])
    for enc, atypes, qtypes in loader:
        enc = enc.to(device)
        labels = enc.pop("labels")
        with torch.autocast("cuda", dtype=torch.float16):
            logits = model(**enc).logits
        pred = logits.argmax(-1)
        s = labels.gather(1, pred.unsqueeze(1)).squeeze(1).tolist()
        for v, at, qt in zip(s, atypes, qtypes):
            total += v
            count += 1
            by_atype[at][0] += v
            by_atype[at][1] += 1
            by_qtype[qt][0] += v
            by_qtype[qt][1] += 1
    model.train()
    acc = 100.0 * total / count
    breakdown = {k: 100.0 * a / b for k, (a, b) in by_atype.items()}
    qbreakdown = {k: 100.0 * a / b for k, (a, b) in sorted(by_qtype.items())}
    return acc, breakdown, qbreakdown


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vqa_root", required=True)
    ap.add_argument("--label_file", default="trainval_label2ans.json")
    ap.add_argument("--init", default="dandelin/vilt-b32-mlm")
    ap.add_argument("--out_dir", default="exp/vilt_vqa")
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=float, default=0.1)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(format="%(asctime)s [%(levelname)s] %(message)s",
                        level=logging.INFO if rank == 0 else logging.ERROR)

    with open(args.label_file) as f:
        label2ans = json.load(f)  # fixed list of 3129 answers
    label2id = {a: i for i, a in enumerate(label2ans)}

    config = ViltConfig.from_pretrained(args.init, num_labels=len(label2ans),
                                        id2label=dict(enumerate(label2ans)), label2id=label2id)
    processor = ViltProcessor.from_pretrained(args.init)
    model = ViltForQuestionAnswering.from_pretrained(args.init, config=config).to(device)
    model = DDP(model, device_ids=[local_rank])

    train_set = VQAv2Dataset(args.vqa_root, "train", label2id)
    val_set = VQAv2Dataset(args.vqa_root, "val", label2id)
    collate = Collator(processor)
    train_sampler = DistributedSampler(train_set)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=64, sampler=DistributedSampler(val_set, shuffle=False),
                            collate_fn=collate, num_workers=8, pin_memory=True)

    no_decay = ("bias", "LayerNorm.weight", "layernorm")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(args.warmup * total_steps), total_steps)
    scaler = torch.cuda.amp.GradScaler()

    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
    best_acc = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        for step, (enc, _, _) in enumerate(train_loader):
            enc = enc.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**enc).loss
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        acc, breakdown, qbreakdown = evaluate(model, val_loader, device)
        if rank == 0:
            log.info("epoch %d val acc %.2f | %s", epoch, acc,
                     " ".join(f"{k}={v:.2f}" for k, v in breakdown.items()))
            with open(os.path.join(args.out_dir, f"val_breakdown_ep{epoch}.json"), "w") as f:
                json.dump({"overall": acc, "answer_type": breakdown, "question_type": qbreakdown}, f, indent=2)
            model.module.save_pretrained(os.path.join(args.out_dir, "last"))
            if acc > best_acc:
                best_acc = acc
                model.module.save_pretrained(os.path.join(args.out_dir, "best"))
                processor.save_pretrained(os.path.join(args.out_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
