"""Objectives own the loss and what evaluation means; the trainer compiles them."""

from dew.objectives.base import Aux, Mean, Objective, PathFilter, Step, Variables
