"""The shared critic-free RL core: rollouts, verifiable rewards, advantage estimators, policy losses and a
LightningModule with manual optimisation (GRPO / Dr.GRPO / RLOO). PS-PPO, Hista, RLKV's probe and SPARD build on it."""
