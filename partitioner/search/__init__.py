"""The planner's searches: candidate stages (``candidates``), the solver layer (``milp``), and the two searches on
top, over chains of candidates (``chain``) and over counts of stage shapes (``shapes``). Pure: numpy, PuLP, HiGHS."""
