"""LLaVA (v1 recipe, mm_use_im_start_end) full fine-tuning of Vicuna-13B with a frozen
CLIP ViT-L/14 under DeepSpeed ZeRO-3.

Image features are wrapped as <im_start> <im_patch>*256 <im_end>; the three new tokens are
added to the tokenizer and their embeddings initialised to the mean of the existing ones.

    deepspeed --num_gpus 8 10_llava_v1_13b_zero3.py --data /data/llava_instruct_150k.json \
        --image-folder /data/coco/train2017 --projector ckpt/llava-13b-pretrain/mm_projector.bin \
        --out ckpt/llava-13b-v1-ft
"""
import argparse
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPVisionModel, LlamaForCausalLM
from transformers.integrations import HfDeepSpeedConfig

IM_PATCH, IM_START, IM_END = "<im_patch>", "<im_start>", "<im_end>"
N_PATCH = 256
SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
          "The assistant gives helpful, detailed, and polite answers to the human's questions.")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--llm", default="lmsys/vicuna-13b-v1.3")
    p.add_argument("--vision-tower", default="openai/clip-vit-large-patch14")
    p.add_argument("--data", required=True)
    p.add_argument("--image-folder", required=True)
    p.add_argument("--projector", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class LlavaModel(nn.Module):
    def __init__(self, llm, vision, im_patch_id):
        super().__init__()
        self.llm = llm
        self.vision = vision
        self.mm_projector = nn.Linear(vision.config.hidden_size, llm.config.hidden_size)
        self.im_patch_id = im_patch_id

    def forward(self, input_ids, attention_mask, images, labels):
        with torch.no_grad():
            feats = self.vision(images, output_hidden_states=True).hidden_states[-2][:, 1:]
        img = self.mm_projector(feats)
        embeds = self.llm.get_input_embeddings()(input_ids)
        mask = input_ids == self.im_patch_id
        embeds = embeds.masked_scatter(mask.unsqueeze(-1), img.to(embeds.dtype).reshape(-1, img.size(-1)))
        return self.llm(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels).loss


class InstructDataset(Dataset):
    def __init__(self, path, image_folder, tokenizer, processor, max_len):
        self.items = json.load(open(path))
        self.image_folder, self.tok, self.proc, self.max_len = image_folder, tokenizer, processor, max_len
        self.image_str = IM_START + IM_PATCH * N_PATCH + IM_END

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        ex = self.items[i]
        image = Image.open(os.path.join(self.image_folder, ex["image"])).convert("RGB")
        pix = self.proc(image, return_tensors="pt").pixel_values[0]
        ids, labels = [self.tok.bos_token_id], [-100]
        text = SYSTEM + " "
        for j, turn in enumerate(ex["conversations"]):
            value = turn["value"].replace("<image>", self.image_str) if j == 0 else turn["value"]
            if turn["from"] == "human":
                seg = self.tok(text + "USER: " + value + " ASSISTANT:", add_special_tokens=False).input_ids
                ids += seg
                labels += [-100] * len(seg)
                text = ""
            else:
                seg = self.tok(" " + value + "</s>", add_special_tokens=False).input_ids
                ids += seg
                labels += seg
        ids, labels = ids[: self.max_len], labels[: self.max_len]
        return torch.tensor(ids), torch.tensor(labels), pix


def collate(batch, pad_id):
    ids = nn.utils.rnn.pad_sequence([b[0] for b in batch], batch_first=True, padding_value=pad_id)
    lab = nn.utils.rnn.pad_sequence([b[1] for b in batch], batch_first=True, padding_value=-100)
    return ids, ids.ne(pad_id), torch.stack([b[2] for b in batch]), lab


def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    torch.cuda.set_device(local_rank)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1, "warmup_num_steps": 1}},
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "stage3_gather_16bit_weights_on_model_save": True},
    }
    dschf = HfDeepSpeedConfig(ds_config)  # keep alive: from_pretrained loads straight into ZeRO-3 shards

    tokenizer = AutoTokenizer.from_pretrained(args.llm, use_fast=False, model_max_length=args.max_len)
    tokenizer.pad_token = tokenizer.unk_token
    processor = CLIPImageProcessor.from_pretrained(args.vision_tower)
    llm = LlamaForCausalLM.from_pretrained(args.llm, torch_dtype=torch.bfloat16)
    vision = CLIPVisionModel.from_pretrained(args.vision_tower, torch_dtype=torch.bfloat16)
    vision.requires_grad_(False)
    llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    llm.config.use_cache = False

    num_new = tokenizer.add_tokens([IM_PATCH, IM_START, IM_END], special_tokens=True)
    llm.resize_token_embeddings(len(tokenizer))
    if num_new > 0:
        input_embeddings = llm.get_input_embeddings().weight.data
        output_embeddings = llm.get_output_embeddings().weight.data
        input_embeddings[-num_new:] = input_embeddings[:-num_new].mean(dim=0, keepdim=True)
        output_embeddings[-num_new:] = output_embeddings[:-num_new].mean(dim=0, keepdim=True)

    model = LlavaModel(llm, vision, tokenizer.convert_tokens_to_ids(IM_PATCH))
    proj = torch.load(args.projector, map_location="cpu")
    model.mm_projector.load_state_dict({k.split("mm_projector.")[-1]: v for k, v in proj.items()})
    model.mm_projector.to(torch.bfloat16)

    dataset = InstructDataset(args.data, args.image_folder, tokenizer, processor, args.max_len)
    sampler = DistributedSampler(dataset, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler, num_workers=4, drop_last=True,
                        collate_fn=lambda b: collate(b, tokenizer.pad_token_id))
    total = args.epochs * len(loader) // args.grad_accum
    ds_config["scheduler"]["params"] = {"total_num_steps": total, "warmup_num_steps": int(0.03 * total),
                                        "warmup_type": "linear"}

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    device = engine.device

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for ids, att, pix, lab in loader:
            loss = engine(ids.to(device), att.to(device), pix.to(device, torch.bfloat16), lab.to(device))
            engine.backward(loss)
            engine.step()
            step += 1
            if step % (10 * args.grad_accum) == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} micro-step {step} loss {l.item():.4f} "
                          f"lr {engine.get_lr()[0]:.2e}", flush=True)
        engine.save_checkpoint(args.out, tag=f"epoch{epoch}")

    # consolidate bf16 weights (collective) and export in HF format from rank 0
    state = engine._zero3_consolidated_16bit_state_dict()
    if rank == 0:
        llm_state = {k[len("llm."):]: v for k, v in state.items() if k.startswith("llm.")}
        llm.save_pretrained(os.path.join(args.out, "hf"), state_dict=llm_state)
        tokenizer.save_pretrained(os.path.join(args.out, "hf"))
        torch.save({k: v for k, v in state.items() if k.startswith("mm_projector.")},
                   os.path.join(args.out, "hf", "mm_projector.bin"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
