"""Fine-tune Salesforce/blip-image-captioning-base on COCO Karpathy train,
report BLEU-4 / CIDEr on the full Karpathy val split after every epoch.

torchrun --nproc_per_node=8 15_blip_caption_finetune.py --coco_root /data/coco
"""
import argparse
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from transformers import BlipForConditionalGeneration, BlipProcessor, get_cosine_schedule_with_warmup
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

logger = logging.getLogger("blip_ft")
PROMPT = "a picture of "


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coco_root", required=True)
    ap.add_argument("--karpathy_json", default=None)
    ap.add_argument("--model_name", default="Salesforce/blip-image-captioning-base")
    ap.add_argument("--output_dir", default="outputs/blip_coco")
    ap.add_argument("--train_batch_size", type=int, default=32)
    ap.add_argument("--eval_batch_size", type=int, default=64)
    ap.add_argument("--num_epochs", type=int, default=5)
    ap.add_argument("--learning_rate", type=float, default=1e-5)
    ap.add_argument("--weight_decay", type=float, default=0.05)
    ap.add_argument("--warmup_ratio", type=float, default=0.1)
    ap.add_argument("--num_beams", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    return ap.parse_args()


class CocoKarpathy(Dataset):
    def __init__(self, karpathy_json, coco_root, split):
        with open(karpathy_json) as f:
            images = json.load(f)["images"]
        keep = ("train", "restval") if split == "train" else (split,)
        images = [im for im in images if im["split"] in keep]
        self.coco_root = coco_root
        self.is_train = split == "train"
        if self.is_train:
            self.samples = [(im["filepath"], im["filename"], im["cocoid"], s["raw"].strip().lower())
                            for im in images for s in im["sentences"]]
        else:
            self.samples = [(im["filepath"], im["filename"], im["cocoid"], None) for im in images]
        self.references = {im["cocoid"]: [s["raw"] for s in im["sentences"]] for im in images}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        folder, fname, cocoid, caption = self.samples[idx]
        image = Image.open(os.path.join(self.coco_root, folder, fname)).convert("RGB")
        return image, caption, cocoid


def make_collate(processor, train):
    prompt_len = len(processor.tokenizer(PROMPT, add_special_tokens=False).input_ids) + 1  # + [CLS]/bos

    def collate(batch):
        images, captions, ids = zip(*batch)
        if not train:
            enc = processor(images=list(images), text=[PROMPT] * len(images), return_tensors="pt")
            return enc, torch.tensor(ids)
        enc = processor(images=list(images), text=[PROMPT + c for c in captions], padding="longest",
                        truncation=True, max_length=40, return_tensors="pt")
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        labels[:, :prompt_len] = -100
        enc["labels"] = labels
        return enc
    return collate


def coco_scores(preds, refs):
    ptb = PTBTokenizer()
    gts = ptb.tokenize({k: [{"caption": c} for c in refs[k]] for k in preds})
    res = ptb.tokenize({k: [{"caption": v}] for k, v in preds.items()})
    bleu, _ = Bleu(4).compute_score(gts, res)
    cider, _ = Cider().compute_score(gts, res)
    return {"Bleu_4": bleu[3], "CIDEr": cider}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")

    karpathy_json = args.karpathy_json or os.path.join(args.coco_root, "annotations", "dataset_coco.json")
    processor = BlipProcessor.from_pretrained(args.model_name)
    train_dataset = CocoKarpathy(karpathy_json, args.coco_root, "train")
    val_dataset = CocoKarpathy(karpathy_json, args.coco_root, "val")

    train_sampler = DistributedSampler(train_dataset, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_dataset, batch_size=args.train_batch_size, sampler=train_sampler,
                              collate_fn=make_collate(processor, True), num_workers=8, pin_memory=True,
                              drop_last=True)
    val_loader = DataLoader(val_dataset, batch_size=args.eval_batch_size,
                            sampler=DistributedSampler(val_dataset, shuffle=False),
                            collate_fn=make_collate(processor, False), num_workers=8, pin_memory=True)

    model = BlipForConditionalGeneration.from_pretrained(args.model_name).to(device)
    model = DDP(model, device_ids=[local_rank])

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    num_update_steps = math.ceil(len(train_dataset) / args.train_batch_size) * args.num_epochs
    num_warmup_steps = int(args.warmup_ratio * num_update_steps)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_update_steps)
    logger.info("world_size=%d, %d update steps (%d warmup)", world_size, num_update_steps, num_warmup_steps)

    best_cider = 0.0
    global_step = 0
    for epoch in range(args.num_epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        start = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                outputs = model(pixel_values=batch["pixel_values"], input_ids=batch["input_ids"],
                                attention_mask=batch["attention_mask"], labels=batch["labels"])
            loss = outputs.loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            if global_step % 50 == 0:
                reduced = loss.detach().clone()
                dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d loss %.4f lr %.3e %.2fs/it", epoch, global_step, reduced.item(),
                            scheduler.get_last_lr()[0], (time.time() - start) / 50)
                start = time.time()

        model.eval()
        predictions = {}
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for enc, image_ids in val_loader:
                enc = enc.to(device)
                generated = model.module.generate(pixel_values=enc.pixel_values, input_ids=enc.input_ids,
                                                  attention_mask=enc.attention_mask, num_beams=args.num_beams,
                                                  max_length=30, min_length=5)
                texts = processor.batch_decode(generated, skip_special_tokens=True)
                for iid, text in zip(image_ids.tolist(), texts):
                    predictions[iid] = text[len(PROMPT):].strip() if text.startswith(PROMPT) else text.strip()
        all_predictions = [None] * world_size
        dist.all_gather_object(all_predictions, predictions)

        if rank == 0:
            merged = {}
            for p in all_predictions:
                merged.update(p)
            scores = coco_scores(merged, val_dataset.references)
            logger.info("epoch %d: %s (%d images)", epoch, json.dumps(scores), len(merged))
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, f"val_captions_epoch{epoch}.json"), "w") as f:
                json.dump([{"image_id": k, "caption": v} for k, v in merged.items()], f)
            if scores["CIDEr"] > best_cider:
                best_cider = scores["CIDEr"]
                model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                processor.save_pretrained(os.path.join(args.output_dir, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
