"""LLaVA-style multimodal training with DeepSpeed ZeRO-3 (13B LLM does not fit
replicated).  Vision tower frozen; LLM and projector trained.

    deepspeed --num_gpus 8 15_llava_deepspeed_zero3.py --data llava_instruct_150k.json \
        --image-folder /data/coco/train2017 --projector ckpt/stage1/mm_projector.bin --out ckpt/llava13b_s2
"""
import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, CLIPImageProcessor, CLIPVisionModel
from transformers.integrations import HfDeepSpeedConfig

IGNORE_INDEX = -100


def ds_config(args):
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.total_steps, "warmup_num_steps": int(0.03 * args.total_steps)}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 50,
        "wall_clock_breakdown": False,
    }


class InstructData(Dataset):
    def __init__(self, path, image_folder, tok, improc, max_len=2048):
        self.rows = [r for r in json.load(open(path)) if "image" in r]
        self.image_folder, self.tok, self.improc, self.max_len = image_folder, tok, improc, max_len

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        pix = self.improc(Image.open(os.path.join(self.image_folder, r["image"])).convert("RGB"),
                          return_tensors="pt").pixel_values[0]
        ids, labels = [self.tok.bos_token_id], [IGNORE_INDEX]
        for t in r["conversations"]:
            text = t["value"].replace("<image>", "").strip()
            if t["from"] == "human":
                x = self.tok("USER: " + text + " ASSISTANT:", add_special_tokens=False).input_ids
                ids, labels = ids + x, labels + [IGNORE_INDEX] * len(x)
            else:
                x = self.tok(" " + text + "</s>", add_special_tokens=False).input_ids
                ids, labels = ids + x, labels + x
        return pix, torch.tensor(ids[:self.max_len]), torch.tensor(labels[:self.max_len])


def collate(batch, pad_id):
    pix, ids, labels = zip(*batch)
    L = max(len(x) for x in ids)
    I = torch.full((len(ids), L), pad_id)
    Y = torch.full((len(ids), L), IGNORE_INDEX)
    M = torch.zeros((len(ids), L), dtype=torch.long)
    for k, (a, b) in enumerate(zip(ids, labels)):
        I[k, :len(a)], Y[k, :len(b)], M[k, :len(a)] = a, b, 1
    return torch.stack(pix), I, Y, M


class Llava(nn.Module):
    def __init__(self, llm, vision_hidden):
        super().__init__()
        self.llm = llm
        h = llm.config.hidden_size
        self.mm_projector = nn.Sequential(nn.Linear(vision_hidden, h), nn.GELU(), nn.Linear(h, h))

    def forward(self, image_feats, input_ids, labels, attention_mask):
        img = self.mm_projector(image_feats)
        tok = self.llm.get_input_embeddings()(input_ids)
        B, N, _ = img.shape
        x = torch.cat([tok[:, :1], img.to(tok.dtype), tok[:, 1:]], 1)
        y = torch.cat([labels[:, :1], labels.new_full((B, N), IGNORE_INDEX), labels[:, 1:]], 1)
        m = torch.cat([attention_mask[:, :1], attention_mask.new_ones(B, N), attention_mask[:, 1:]], 1)
        return self.llm(inputs_embeds=x, attention_mask=m, labels=y).loss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=-1)
    ap.add_argument("--llm", default="lmsys/vicuna-13b-v1.5")
    ap.add_argument("--vision", default="openai/clip-vit-large-patch14-336")
    ap.add_argument("--projector", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--image-folder", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save-every", type=int, default=500)
    args = ap.parse_args()

    deepspeed.init_distributed(dist_backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.llm, use_fast=False)
    tok.pad_token = tok.unk_token
    improc = CLIPImageProcessor.from_pretrained(args.vision)
    vision = CLIPVisionModel.from_pretrained(args.vision, torch_dtype=torch.bfloat16).to(device).eval()
    vision.requires_grad_(False)

    dataset = InstructData(args.data, args.image_folder, tok, improc)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler, num_workers=4, drop_last=True,
                        collate_fn=lambda b: collate(b, tok.pad_token_id), pin_memory=True)
    args.total_steps = args.epochs * len(loader) // args.grad_accum
    config = ds_config(args)

    # must stay alive while the model is built: from_pretrained then loads the
    # LLM straight into ZeRO-3 partitions, no rank holds the full 13B weights
    dschf = HfDeepSpeedConfig(config)  # noqa: F841
    llm = AutoModelForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    model = Llava(llm, vision.config.hidden_size)
    model.mm_projector.load_state_dict(torch.load(args.projector, map_location="cpu"))
    llm.config.use_cache = False
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for pix, ids, labels, mask in loader:
            pix = pix.to(device, dtype=torch.bfloat16, non_blocking=True)
            with torch.no_grad():
                feats = vision(pix, output_hidden_states=True).hidden_states[-2][:, 1:]
            loss = engine(feats, ids.to(device), labels.to(device), mask.to(device))
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()

            if boundary:
                gstep = engine.global_steps
                if gstep % 10 == 0:
                    l = loss.detach().float()
                    dist.all_reduce(l, op=dist.ReduceOp.AVG)
                    if rank == 0:
                        print(f"epoch {epoch} step {gstep}/{args.total_steps} loss {l.item():.4f} "
                              f"lr {engine.get_lr()[0]:.2e}", flush=True)
                if gstep % args.save_every == 0:
                    engine.save_checkpoint(args.out, tag=f"step{gstep}")
                    if rank == 0:
                        torch.save(engine.module.mm_projector.state_dict(),
                                   os.path.join(args.out, f"mm_projector_step{gstep}.bin"))

    engine.save_checkpoint(args.out, tag="final")
    engine.save_16bit_model(args.out, "pytorch_model.bin")
    if rank == 0:
        torch.save(engine.module.mm_projector.state_dict(), os.path.join(args.out, "mm_projector.bin"))
        tok.save_pretrained(args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
