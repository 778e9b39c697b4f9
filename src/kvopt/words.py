"""Embedded English word lists: RULER's keys and cwe (RULER downloads wonderwords; we ship our own), and the facts
planted in locret's training text."""

from __future__ import annotations

ADJECTIVES: tuple[str, ...] = tuple(
    """
    able absent active actual afraid agile alert alive ancient angry anxious aware awful basic bitter blank bold
    brave brief bright broad broken busy calm careful casual cheap chief civil classic clean clear clever close
    cloudy coarse cold common complex cool correct cosmic crazy crisp cruel curious cute damp daring dark dear
    decent deep dense direct dirty distant dizzy eager early easy elegant empty endless equal exact extra faint
    fair false famous fancy fast fatal fierce final fine firm flat fluffy fond formal fragile free fresh friendly
    frozen full funny gentle giant glad global golden good grand grateful great green grumpy guilty happy hard
    harsh heavy helpful hidden high hollow honest hot huge humble hungry icy ideal idle immense jolly juicy keen
    kind large late lazy legal light little lively lonely long loose loud lovely loyal lucky lunar magic major
    mature mellow mild minor modern moist narrow nasty native naval neat nervous noble noisy normal odd open
    orange pale plain polite poor precise pretty proud pure purple quick quiet rapid rare ready real red rich
    rigid ripe rough round royal rural rusty sacred sad safe salty scarce secret serious shallow sharp shiny short
    shy silent silly simple sleepy slim slow small smart smooth soft solar solid sour spare spicy stale steady
    steep stiff strange strict strong sturdy subtle sudden sunny super sweet swift tall tame tender thick thin
    tidy tiny tough tricky true ugly unique upper urban usual vague valid vast vivid warm wary weak wealthy weary
    wet whole wide wild wise witty wooden young zealous
    """.split()
)

NOUNS: tuple[str, ...] = tuple(
    """
    acorn airport album anchor ankle apple apron arrow attic badge bakery balloon bamboo banana banjo barrel basket
    beach beacon beetle bell bench bicycle blanket blossom boat bottle bracelet branch bread brick bridge broom
    bucket butter button cabin cactus camera candle canoe canyon carpet carrot castle cave cellar chair cherry
    chimney circus cliff clock cloud coconut comet compass cookie copper corner cotton crayon crown cup curtain
    cushion daisy desert diamond dolphin donkey door dragon drum eagle easel elbow engine falcon feather fence
    fiddle finger flag flute forest fountain fox garden garlic giraffe glacier glove goat guitar hammer harbor
    harp helmet hill honey horizon horse island jacket jelly jewel kettle kitten ladder lake lamp lantern lemon
    letter lily lion lizard locket magnet mango maple marble meadow mirror monkey moon mountain muffin napkin
    needle nest notebook ocean olive onion orchard otter owl paddle palace panda parrot peach pebble pencil
    pepper piano pillow pirate planet pocket pond potato pumpkin puzzle quilt rabbit radio rainbow raven ribbon
    river robot rocket saddle sailor salmon sandal scarf shell ship shovel silver skate sled snail spider spoon
    squirrel stable statue stone stove sugar sunset swan table teapot temple thunder tiger tomato tower tractor
    train trumpet tulip tunnel turtle umbrella valley vase violin wagon walnut whale wheel whistle window wizard
    wolf yacht zebra
    """.split()
)

COMMON_WORDS: tuple[str, ...] = tuple(
    """
    ability absence academy accent accept access accident account achieve acid acquire action actor adapt addition
    address adjust admire admit adopt adult advance advice affair afford agency agenda agent agree airline alarm
    alley allow almond amount analyze angle animal announce annual answer anxiety apology appeal appear appetite
    apply appoint approve argue arise armor arrange arrive article artist aspect assess asset assist assume assure
    athlete attach attempt attend attitude attract auction author autumn average avoid award backpack baggage
    balance ballet bandage banker bargain barrier baseball battery battle beard beast beauty bedroom behave
    behavior belief belong benefit bishop blade blame blend bless block blood borrow bother bottom bounce boundary
    brain brand breath breathe breed brush budget buffalo build bundle burden burst butcher cabbage cable calendar
    campaign canal cancel capital captain carbon career cargo carry cartoon carve cattle cause ceiling celebrate
    cement census cereal ceremony chain chalk champion channel chapter charity charm chase cheek cheese chemistry
    chest chicken choice choose chorus circle citizen claim clarify climate climb clinic cluster coach coast
    collapse collect college colony column combine comfort command comment commit company compare compete
    complain compose concept concern concert conduct confirm conflict connect consider consist contain content
    contest context continue contract control convert convince cooking corridor cottage council counter country
    couple courage course cousin craft crash create credit crew cricket crisis critic crop crowd cruise crystal
    culture cupboard currency custom customer cycle dancer danger deadline debate debris decade decide declare
    decline decorate decrease defeat defend define degree delay delight deliver demand denial dentist depart
    depend deposit depth deputy derive describe deserve design desire detail detect develop device devote
    dialogue diary diet differ digital dignity dilemma dinner dinosaur diploma disagree discount discover discuss
    dismiss display distance district divide doctor document domain donate double doubt dozen draft drama drawer
    dream dress drift drink drive drought duty dwarf dynamic earn earth echo economy edge edition educate effect
    effort elder elect element elevator embrace emerge emotion emphasis employ empire enable encounter enemy
    energy engage enhance enjoy enlarge ensure enter entry envelope episode equation erase error escape essay
    estate estimate evening event evidence evolve examine example exceed excess exchange excite excuse execute
    exercise exhibit exist expand expect expense expert explain explode explore export expose express extend
    extract fabric factor factory faculty failure fairy faith family farmer fashion fault favor feast feature
    festival fever fiction field figure filter finance finish fishing fitness flavor flight float flood flower
    fluid focus folder follow football forecast forget forgive format formula fortune forum fossil foundation
    fraction frame freedom freight frequency friend frontier fruit fuel function furniture gadget gallery garage
    gather gender generate genius gesture ghost gift ginger glance glass glimpse glory govern gown grace grade
    grain grammar gravity grief grocery growth guard guess guest guide guilt habit hamster handle happen harvest
    hazard headline health heaven height heritage highway hobby holiday honor horror hotel household hunger
    hunter hurdle husband ignore illness image imagine impact import impose improve impulse incident include
    income increase index indicate industry infant inflate inform inherit initial injury innocent inquiry insect
    insert insight insist inspect install instance instinct intend interest interval invest invite involve iron
    issue item ivory jazz journey judge juice junior jury justice kidney kingdom kitchen knife knock label labor
    landscape language laptop laser laundry lawyer layer leader leaflet league learn lecture legend leisure lesson
    level liberty library license lifestyle limit linger liquid listen literature livestock lobby locate lottery
    lounge luggage lumber machine magazine majority manage mandate mansion manual margin market marriage master
    match material matter maximum meaning measure medal media medicine melody member memory mention menu merchant
    mercy message metal method middle migrate mineral minimum minister minute miracle mission mistake mixture
    mobile model moment monitor monster month morning mortgage motion motive motor movie muscle museum music
    mystery nation nature nephew network noodle notice notion novel number nurse object observe obtain occasion
    occupy offer office officer opinion oppose option orbit order organ origin outcome outfit outline output oven
    owner oxygen package painter panel panic parade paradise parcel parent parking partner passage passion pastry
    patch patent patient pattern pause payment peanut penalty pension perform period permit person phase phrase
    physics picnic picture pilot pioneer pitch plastic platform player pleasure pledge plenty poetry police
    policy portion portrait position poster pottery poverty powder power practice praise predict prefer premium
    prepare present preserve pressure prevent price pride priest primary prince print priority privacy prize
    problem process produce product profile profit program project promise promote proof property proposal
    protect protein protest provide public publish pudding pulse punch pupil purchase purpose pursue quality
    quantity quarter question quota radar railway rally ranch random ratio reaction reader reality reason rebel
    recall receipt recipe record recover reduce reform refuse region regret reject relate release relief remedy
    remind remove rental repair repeat replace report request rescue research resident resist resort resource
    respect respond result retain retire return reveal review reward rhythm riddle ritual rival romance routine
    rubber ruler rumor sailing salad sample sanction satellite sauce sausage scandal scholar science score screen
    script sculpture season secretary section sector seminar senior sense sentence series servant service session
    settle shadow shelter sheriff shortage shoulder signal silence singer sister sketch skill slogan soccer
    society soldier solution source speaker species speech spirit sponsor sport spring square stadium staff stage
    standard station status steam stomach storage story strategy stream street stress stretch strike stroke
    structure student studio subject suburb success suggest summer summit supply support surface surgeon surprise
    survey suspect sweater symbol symptom system tactic talent target teacher teenager tennis tension terminal
    territory theater theme theory therapy thesis thought threat ticket timber tissue title toast toilet tongue
    topic torch tourist trade traffic tragedy trail trainer transfer travel treasure treaty trend trial tribe
    trick trophy trouble truck trust truth tuition tutor twist uncle uniform union unit universe update upgrade
    vacuum variety vehicle velvet venture verdict version vessel veteran victory video vintage virus vision visit
    visitor vitamin voice volume volunteer voyage wage waiter wallet warrior waste wealth weather website wedding
    weekend welfare winner winter wisdom witness wonder worker workshop writer yard yogurt youth zone
    """.split()
)

WORD_POOL: tuple[str, ...] = tuple(sorted(set(ADJECTIVES + NOUNS + COMMON_WORDS)))
"""Every distinct embedded word: cwe draws its common and uncommon words from here."""
